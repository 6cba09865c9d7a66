"""One question: on a GPU, are a DiT GEMM's rows computed from a row shard (a Ulysses rank's tokens) the same
bits as the whole GEMM's, per shard size, with cuBLASLt's split-K allowed and not, and what does forbidding
split-K cost?

    python3 benchmarks/gemm_rows.py --model 14b --tokens 3120      # one GPU, ~1 min

`generate --gpus N` keeps one GPU's frames only if every linear layer's output row is independent of how
many rows its call has: the Ulysses ranks call each layer with 1/N of the tokens (batched CFG: 2 x S / N
rows). cuBLAS picks its kernel by shape, and a split-K (or stream-K) kernel sums a row's products in
another order. For each of the DiT's linear shapes (bias as the model has it; the FFN's up projection
with its GELU epilogue), the whole call (rows = 2 x tokens) against calls on its first rows / N for N in
--shards: equal bits or the max abs difference; each setting of
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction's split-K flag; then each shape's time
at the whole and the 1/4 shard, both settings.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_utils import median_ms, print_table  # noqa: E402
from wan_models import MODELS  # noqa: E402


def shapes(model: str) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, gelu epilogue) of the DiT's linear layers that run on a rank's tokens."""
    config = MODELS[model][0]
    d, ffn = config.dim, config.ffn_dim
    return [
        ("qkv stacked", d, 3 * d, False),
        ("attn out / cross q", d, d, False),
        ("cross k/v stacked", d, 2 * d, False),
        ("ffn up + gelu", d, ffn, True),
        ("ffn down", ffn, d, False),
        ("proj out", d, config.out_channels * math.prod(config.patch_size), False),
    ]


def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gelu:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return torch.nn.functional.linear(x, weight, bias)


def set_splitk(allowed: bool) -> None:
    """torch's default (reduced-precision reductions and split-K allowed), or neither (split-K off needs
    reduced precision off)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (allowed, allowed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="14b")
    parser.add_argument("--tokens", type=int, default=3120, help="one sample's tokens (480x832x5: 3120)")
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    rows = 2 * args.tokens
    equal_rows, time_rows = [], []
    for name, k, n, gelu in shapes(args.model):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=generator)
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * k**-0.5
        bias = torch.randn(n, device=device, dtype=torch.bfloat16, generator=generator)
        for splitk in (True, False):
            set_splitk(splitk)
            whole = call(x, weight, bias, gelu)
            cells = []
            for shard in args.shards:
                part = call(x[: rows // shard].contiguous(), weight, bias, gelu)
                diff = (part.float() - whole[: rows // shard].float()).abs().max().item()
                cells.append("equal" if torch.equal(part, whole[: rows // shard]) else f"{diff:.1e}")
            equal_rows.append((name, f"{k}x{n}", "yes" if splitk else "no", *cells))
        times = []
        for splitk in (True, False):
            set_splitk(splitk)
            for count in (rows, rows // 4):
                part = x[:count].contiguous()
                times.append(
                    median_ms(
                        lambda part=part, weight=weight, bias=bias, gelu=gelu: call(part, weight, bias, gelu),
                        device,
                        warmup=3,
                        iters=10,
                    )
                )
        time_rows.append((name, f"{k}x{n}", *(f"{t:.3f}" for t in times)))
    set_splitk(True)
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | model {args.model} | rows {rows} (2 x {args.tokens})"
    )
    print("\nrows of a shard against the whole call's (equal bits, else max abs difference)")
    print_table(
        [("layer", 20), ("K x N", 12), ("split-K", 8), *((f"1/{s} rows", 10) for s in args.shards)],
        equal_rows,
    )
    print("\nms per call: split-K allowed (whole, 1/4), split-K off (whole, 1/4)")
    print_table(
        [("layer", 20), ("K x N", 12), ("on whole", 9), ("on 1/4", 9), ("off whole", 9), ("off 1/4", 9)],
        time_rows,
    )


if __name__ == "__main__":
    main()
