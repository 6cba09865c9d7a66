"""The `enhance` subcommand: `mmgen enhance "prompt" --model DIR` prints the rewritten prompt.

`register(subparsers)` adds it to the `mmgen` parser (it sets `func(args) -> exit code`). Also
runnable alone: `python -m mmgen.llm.cli enhance "prompt" --model DIR`.
Exit codes: 0 success; 2 invalid input or a model that cannot be loaded (one-line error).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mmgen.errors import MmgenError, ValidationError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `enhance` to an argparse subparsers object."""
    enhance = subparsers.add_parser(
        "enhance",
        help="rewrite a short prompt into a detailed one with a T5Gemma encoder-decoder",
        description="Rewrite a prompt with an HF-format T5Gemma checkpoint directory and print the result.",
    )
    enhance.add_argument("prompt", help="the prompt to rewrite")
    enhance.add_argument(
        "--model", required=True, help="T5Gemma directory (config.json, safetensors, tokenizer.json)"
    )
    enhance.add_argument(
        "--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)"
    )
    enhance.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    enhance.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    enhance.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)"
    )
    enhance.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    enhance.add_argument("--raw", action="store_true", help="feed the prompt as is, without the instruction")
    enhance.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    enhance.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (or fp32 | bf16 | fp16); default: bfloat16 on cuda, float32 on cpu",
    )
    enhance.set_defaults(func=_enhance_command)


def _enhance_command(args: argparse.Namespace) -> int:
    # torch and the LLM runtime: not at `mmgen --help`
    import torch

    from mmgen.dtypes import check_dtype
    from mmgen.llm.enhancer import DEFAULT_TEMPLATE, RAW_TEMPLATE, PromptEnhancer
    from mmgen.llm.sampling import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch_device = torch.device(device)
    except RuntimeError as err:
        raise ValidationError(f"--device {device!r} is not a torch device ({err})") from err
    dtype = check_dtype(args.dtype or ("bfloat16" if torch_device.type == "cuda" else "float32"))
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    enhancer = PromptEnhancer.from_pretrained(
        args.model,
        device=torch_device,
        dtype=dtype,
        template=RAW_TEMPLATE if args.raw else DEFAULT_TEMPLATE,
        params=params,
    )
    print(enhancer(args.prompt))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m mmgen.llm.cli enhance ...`; errors print as one line, no traceback."""
    parser = argparse.ArgumentParser(prog="mmgen")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MmgenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
