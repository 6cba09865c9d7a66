"""One Qwen-Image-2.1 step on one GPU: mmgen's block-causal varlen call and cached prefix against diffusers.

Run from the repository root on a CUDA machine with diffusers 0.42.1 (fa3-fwd / flash-attn-4 optional):

    python3 benchmarks/qwen_image21_step.py                  # 7.12 B, T2I 1024 and 1536, edit 1024 + 1024
    python3 benchmarks/qwen_image21_step.py --cases t2i1024  # one case
    python3 benchmarks/qwen_image21_step.py --tiny           # CPU smoke run of the harness (tiny config)

Random bf16 weights go into diffusers' QwenImage21Transformer2DModel (its default per-segment SDPA
processor, QwenImage21AttnProcessor) and, sharing the same tensors, into mmgen's QwenImage21Transformer.
Per case three rows each: a step without the cache (the whole joint sequence), the prefill (the same
call, filling the cache) and a cached step (the target's queries only, keys prefix + target). The text
is --text-len tokens (an edit's condition image adds its 2x2 slots inside the prompt). Printed: ms
(median of --iters after warm-up, CUDA events), the ratio to the floor and diffusers' speed over ours
for the same kind of step, max abs difference of the prediction from diffusers', and the peak memory
a row allocates above the weights (a cached row: above the weights and the filled cache). The floor
counts the block-causal attention FLOPs (4 d per head, layer and allowed query-key pair) at the
measured attention peak plus 2 x linear parameters x tokens at the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, and the tests' tiny config

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    attention_peaks,
    bench_device,
    environment_header,
    floor_ms,
    matmul_peak,
    max_abs,
    one_line,
    print_kernel_breakdown,
    print_table,
    timed,
    write_json,
)
from qwen_image21_cases import TINY_TRANSFORMER  # noqa: E402
from torch import nn  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Config, QwenImage21Transformer  # noqa: E402
from mmgen.models.qwen_image21_layout import BlockCausalLayout  # noqa: E402

# case -> (condition image sides in pixels, target side); sides are multiples of 32.
CASES = {"t2i1024": ((), 1024), "t2i1536": ((), 1536), "edit1024": ((1024,), 1024)}
TINY_CASES = {"t2i1024": ((), 64), "t2i1536": ((), 96), "edit1024": ((64,), 64)}
LEAD_TOKENS = 4  # template tokens before an edit's image slots


def build_models(
    config: dict, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, QwenImage21Transformer]:
    """diffusers' and mmgen's transformer on the same random weights (one copy, shared tensors)."""
    import diffusers

    with torch.device("meta"):
        reference = diffusers.QwenImage21Transformer2DModel(**config)
    reference = reference.to(dtype).to_empty(device=device)
    # Tables made at construction (RoPE attributes, the non-persistent timestep frequencies): rebuild
    # them for real, in float32 as from_pretrained keeps them.
    embed = reference.time_text_embed
    embed.time_proj = type(embed.time_proj)(timestep_dim=256).to(device)
    rope = reference.pos_embed
    reference.pos_embed = type(rope)(theta=rope.theta, axes_dim=list(rope.axes_dim))
    fill_random(reference, device)
    with torch.device("meta"):
        ours = QwenImage21Transformer(QwenImage21Config.from_diffusers(dict(reference.config)))
    ours.load_state_dict(reference.state_dict(), assign=True)
    return reference.eval().requires_grad_(False), ours.eval().requires_grad_(False)


def fill_random(model: nn.Module, device: torch.device, seed: int = 0) -> None:
    """Seeded random weights in place (diffusers' and mmgen's 2.1 share parameter names): the q/k norms
    ones, the zero-centred text norm zero (stored as scale - 1), the rest N(0, 1 / fan-in)."""
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, value in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight")):
                value.fill_(1.0)
            elif "text_norm" in name:
                value.zero_()
            else:
                value.normal_(0.0, value.shape[-1] ** -0.5, generator=generator)


def case_inputs(
    conditions: tuple[int, ...], side: int, text_len: int, config: QwenImage21Config, device, dtype
):
    """diffusers' keyword inputs and mmgen's layout for one sample: text_len text tokens, the condition
    images' slots after LEAD_TOKENS of them, the target last."""
    grids = [(1, s // 16, s // 16) for s in (*conditions, side)]
    slots = sum(h * w // 4 for _, h, w in grids[:-1])
    width = text_len + slots
    slot_mask = torch.zeros(1, width, dtype=torch.bool)
    slot_mask[0, LEAD_TOKENS : LEAD_TOKENS + slots] = True
    generator = torch.Generator(device).manual_seed(1)
    tokens = sum(h * w for _, h, w in grids)
    target = grids[-1][1] * grids[-1][2]
    inputs = {
        "hidden_states": torch.randn(
            1, tokens, config.in_channels, device=device, dtype=dtype, generator=generator
        ),
        "encoder_hidden_states": torch.randn(
            1, width, config.context_in_dim, device=device, dtype=dtype, generator=generator
        ),
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_shapes": [grids],
        "img_mask": torch.cat([slot_mask, torch.ones(1, target // 4, dtype=torch.bool)], 1).to(device),
    }
    layout = BlockCausalLayout.build([width], grids, text_width=width, slot_masks=slot_mask, device=device)
    return inputs, layout


def floors(
    model: QwenImage21Transformer, layout: BlockCausalLayout, peaks: dict, matmul: float
) -> tuple[dict, dict]:
    """(uncached floor, cached floor) of one case (module docstring)."""
    config = model.config
    per_pair = 4 * config.attention_head_dim * config.num_attention_heads * config.num_layers
    block_params = sum(p.numel() for p in model.transformer_blocks.parameters())
    text = layout.total_tokens - layout.latent_tokens
    pairs = layout.prefill.pairs
    linear = 2 * block_params * layout.total_tokens + 2 * model.txt_in.in_layer.weight.numel() * text
    uncached = floor_ms(per_pair * pairs, linear, matmul, peaks)
    target = layout.target_tokens
    cached = floor_ms(per_pair * layout.cached.pairs, 2 * block_params * target, matmul, peaks)
    return uncached, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    parser.add_argument("--text-len", type=int, default=200, help="text tokens (after the template drop)")
    parser.add_argument("--backend", default="auto", help="mmgen's attention backend (select_attention)")
    parser.add_argument("--row-kernels", default="auto", help="mmgen's row kernels: auto, on or off")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny config")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="print the N costliest kernels of mmgen's steps"
    )
    args = parser.parse_args()
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    device = bench_device(args.tiny)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cases = TINY_CASES if args.tiny else CASES
    text_len = 12 if args.tiny else args.text_len
    reference, ours = build_models(TINY_TRANSFORMER if args.tiny else {}, device, dtype)
    config = ours.config
    ours.set_row_kernels(args.row_kernels)
    impl = select_attention(args.backend, device=device, dtype=dtype, head_dim=config.attention_head_dim)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    matmul = matmul_peak(device, 8192 if device.type == "cuda" else 256)
    print(environment_header(device))
    print(
        f"Qwen-Image-2.1 step, {sum(p.numel() for p in ours.parameters()) / 1e9:.2f} B, {dtype}, mmgen {impl!r}, "
        f"row kernels {args.row_kernels}"
    )
    table, results = [], {}
    for name in args.cases.split(","):
        conditions, side = cases[name]
        inputs, layout = case_inputs(conditions, side, text_len, config, device, dtype)
        target = layout.target_tokens
        peaks = attention_peaks(
            device, (1, layout.total_tokens, config.num_attention_heads, config.attention_head_dim)
        )
        floor_uncached, floor_cached = floors(ours, layout, peaks, matmul)
        kv = QwenImage21KVCache(config.num_layers)
        text = inputs["encoder_hidden_states"]
        latents, timestep = inputs["hidden_states"], inputs["timestep"]

        def theirs(mode=None, kv=kv, inputs=inputs, target=target):
            cache = {} if mode is None else {"kv_cache": kv, "kv_cache_mode": mode}
            return reference(**inputs, return_dict=False, **cache)[0][:, -target:]

        def mine(cache=None, layout=layout, latents=latents, timestep=timestep, text=text):
            body = None if cache is not None and cache.filled else text
            return ours(latents, timestep, body, metadata=layout, attention=impl, cache=cache)

        with torch.no_grad():
            theirs("extract")
            cache = PrefixCache()
            mine(cache)
            rows = [
                ("uncached", floor_uncached, theirs, mine),
                ("prefill", floor_uncached, lambda: theirs("extract"), lambda: mine(PrefixCache())),
                ("cached", floor_cached, lambda: theirs("cached"), lambda c=cache: mine(c)),
            ]
            for kind, floor, reference_fn, our_fn in rows:
                measured = {}
                for who, fn in (("diffusers", reference_fn), ("mmgen", our_fn)):
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                    try:
                        out, _, times = timed(fn, device, warmup=2, iters=args.iters)
                    except Exception as err:  # noqa: BLE001 - report the row and go on
                        print(f"{name} {kind} {who}: {one_line(err)}")
                        continue
                    peak = (
                        (torch.cuda.max_memory_allocated(device) - base) / 2**30
                        if device.type == "cuda"
                        else None
                    )
                    measured[who] = (out, statistics.median(times), peak)
                if len(measured) < 2:
                    continue
                (ref_out, ref_ms, ref_peak), (out, ms, peak) = measured["diffusers"], measured["mmgen"]
                results[f"{name}/{kind}"] = {
                    "diffusers_ms": ref_ms,
                    "mmgen_ms": ms,
                    "floor_ms": floor["ms"],
                    "max_abs": max_abs(out, ref_out),
                    "diffusers_peak_gib": ref_peak,
                    "mmgen_peak_gib": peak,
                }
                table.append(
                    [
                        f"{name} {kind}",
                        ref_ms,
                        ms,
                        floor["ms"],
                        f"{ms / floor['ms']:.2f}",
                        f"{ref_ms / ms:.2f}x",
                        f"{max_abs(out, ref_out):.2e}",
                        ref_peak,
                        peak,
                    ]
                )
            if args.profile:
                for kind, fn in (("uncached", mine), ("cached", lambda c=cache: mine(c))):
                    print(f"{name} {kind}:", end=" ")
                    print_kernel_breakdown(fn, device, top=args.profile)
        del cache, kv
    print(f"weights {weights / 2**30:.1f} GiB; text {text_len} tokens")
    print_table(
        [
            ("case", 18),
            ("diffusers", 10),
            ("mmgen", 9),
            ("floor", 8),
            ("x floor", 8),
            ("speedup", 8),
            ("max abs", 10),
            ("d GiB", 6),
            ("m GiB", 6),
        ],
        table,
    )
    write_json(
        args.json, {"rows": results, "text_len": text_len, "dtype": str(dtype), "backend": impl.provider}
    )


if __name__ == "__main__":
    main()
