"""One Qwen-Image true-CFG step on one GPU: mmgen's packed call against diffusers and the floor.

Run from the repository root on a CUDA machine with diffusers (fa3-fwd / flash-attn-4 optional):

    python3 benchmarks/qwen_image_step.py                    # Qwen-Image 20B, 1328x1328 (6,889 tokens)
    python3 benchmarks/qwen_image_step.py --text-lens 200,12 # prompts of other token lengths
    python3 benchmarks/qwen_image_step.py --tiny             # CPU smoke run of the harness (tiny config)

Random bf16 weights go into diffusers' QwenImageTransformer2DModel and, sharing the same tensors
(no second copy of the 20B weights), into mmgen's QwenImageTransformer. One step = the conditional
and the unconditional prompt (--text-lens tokens each) over the same latents. Rows: diffusers as its
QwenImagePipeline calls it (two batch-1 calls, no mask); diffusers with both prompts padded to the
longer and masked (what a batch of prompts of different lengths gets); mmgen's packed batch-2 call
(varlen rows of [text_b, image], no padding attended) per attention backend; mmgen's two calls
(cfg sequential). Printed: ms per step (median of --iters after warm-up, CUDA events), ratio to the
floor and to diffusers' pipeline way, max abs error of the cond/uncond outputs against diffusers'
pipeline way, peak memory a row allocates above the weights. The floor counts attention FLOPs (4 S^2 d
per head, layer and prompt, S = text_b + image tokens) at the measured attention peak plus linear
FLOPs (2 x each stream's linear parameters x its tokens) at the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, and the tests' tiny Qwen-Image config

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    attention_peaks,
    bench_device,
    environment_header,
    floor_ms,
    matmul_peak,
    max_abs,
    print_kernel_breakdown,
    print_table,
    timed,
    write_json,
)
from qwen_image_cases import TINY_TRANSFORMER  # noqa: E402
from torch import nn  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.errors import one_line  # noqa: E402
from mmgen.models.qwen_image import QwenImageConfig, QwenImageTransformer  # noqa: E402
from mmgen.models.qwen_image_joint import JointTokens  # noqa: E402

TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp", "txt_in")


def build_models(
    config: dict, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, QwenImageTransformer]:
    """diffusers' and mmgen's transformer on the same random weights (one copy, shared tensors)."""
    import diffusers

    with torch.device("meta"):
        reference = diffusers.QwenImageTransformer2DModel(**config)
    reference = reference.to(dtype).to_empty(device=device)  # bf16 from the start: 41 GB, not 82
    # Its RoPE tables are plain attributes made at construction (not buffers): build them for real.
    rope = reference.pos_embed
    reference.pos_embed = type(rope)(
        theta=rope.theta, axes_dim=list(rope.axes_dim), scale_rope=rope.scale_rope
    )
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, value in reference.named_parameters():
            if "norm" in name:
                value.fill_(1.0)
            elif value.dim() == 2:
                value.normal_(0.0, value.shape[1] ** -0.5, generator=generator)
            else:
                value.normal_(0.0, 0.02, generator=generator)
    with torch.device("meta"):
        ours = QwenImageTransformer(QwenImageConfig.from_diffusers(dict(reference.config)))
    ours.load_state_dict(reference.state_dict(), assign=True)
    return reference.eval().requires_grad_(False), ours.eval().requires_grad_(False)


def linear_flops(model: nn.Module, image_tokens: int, text_lens: list[int]) -> float:
    """2 x params x tokens for every Linear, by the stream it runs on (modulation: one token)."""
    flops = 0.0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        params = module.weight.numel()
        for length in text_lens:  # per prompt
            if "_mod" in name or "time_text_embed" in name or "norm_out" in name:
                flops += 2 * params
            elif any(part in name for part in TEXT_STREAM):
                flops += 2 * params * length
            else:
                flops += 2 * params * image_tokens
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1328, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--text-lens", default="24,12", help="cond,uncond prompt tokens (after the template)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny config")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="print the N costliest kernels of mmgen's packed call"
    )
    args = parser.parse_args()
    device = bench_device(args.tiny)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = TINY_TRANSFORMER if args.tiny else {}
    size = 64 if args.tiny else args.size
    lens = [int(n) for n in args.text_lens.split(",")]
    reference, ours = build_models(config, device, dtype)
    side = size // 16
    tokens = side * side
    generator = torch.Generator(device).manual_seed(1)
    width = ours.config.joint_attention_dim
    latents = torch.randn(1, tokens, ours.config.in_channels, device=device, dtype=dtype, generator=generator)
    texts = [torch.randn(1, n, width, device=device, dtype=dtype, generator=generator) for n in lens]
    padded = torch.zeros(2, max(lens), width, device=device, dtype=dtype)
    mask = torch.zeros(2, max(lens), dtype=torch.int64, device=device)
    for row, text in enumerate(texts):
        padded[row, : text.shape[1]] = text[0]
        mask[row, : text.shape[1]] = 1
    timestep = torch.full((1,), 0.5, device=device, dtype=dtype)
    grid = (1, side, side)

    def diffusers_call(hidden, text, text_mask=None):
        return reference(
            hidden_states=hidden,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=text_mask,
            timestep=timestep.expand(hidden.shape[0]),
            img_shapes=[[grid]] * hidden.shape[0],
            return_dict=False,
        )[0]

    def mmgen_packed(attention, layout):
        return ours(
            latents.expand(2, -1, -1),
            timestep.expand(2),
            padded,
            grids=(grid,),
            attention=attention,
            metadata=layout,
        )

    def mmgen_sequential(attention):
        return torch.cat(
            [ours(latents, timestep, text, grids=(grid,), attention=attention) for text in texts]
        )

    def unfused(call):
        # A/B of the blocks' Triton row kernels (model setup toggled around this row only).
        ours.set_fused_kernels(False)
        try:
            return call()
        finally:
            ours.set_fused_kernels(True)

    rows = {
        "diffusers, pipeline way (2 calls)": lambda: torch.cat([diffusers_call(latents, t) for t in texts])
    }
    rows["diffusers, padded + masked batch"] = lambda: diffusers_call(latents.expand(2, -1, -1), padded, mask)
    layout = JointTokens.build(lens, tokens, text_width=max(lens), device=device)
    backends = ["auto", "sdpa"] + ([] if device.type == "cpu" else ["flash:fa3", "flash:fa4"])
    for backend in backends:
        try:
            impl = select_attention(
                backend, device=device, dtype=dtype, head_dim=ours.config.attention_head_dim
            )
        except Exception as err:  # noqa: BLE001 - a provider that is not installed is a row saying so
            print(f"skip mmgen {backend}: {one_line(err, typed=True)}")
            continue
        label = f"mmgen packed ({impl.name}:{impl.provider})"
        rows[label] = lambda impl=impl: mmgen_packed(impl, layout)
    auto = select_attention("auto", device=device, dtype=dtype, head_dim=ours.config.attention_head_dim)
    if device.type == "cuda":
        rows[f"mmgen packed, row kernels off ({auto.provider})"] = lambda: unfused(
            lambda: mmgen_packed(auto, layout)
        )
    rows["mmgen 2 calls (cfg sequential, auto)"] = lambda: mmgen_sequential(auto)

    heads, head_dim = ours.config.num_attention_heads, ours.config.attention_head_dim
    longest = max(lens) + tokens
    peaks = attention_peaks(device, (1, longest, heads, head_dim))
    attention_flops = sum(4 * (n + tokens) ** 2 * head_dim * heads * ours.config.num_layers for n in lens)
    floor = floor_ms(
        attention_flops,
        linear_flops(ours, tokens, lens),
        matmul_peak(device, 8192 if device.type == "cuda" else 256),
        peaks,
    )

    print(environment_header(device))
    print(
        f"Qwen-Image step: {size}x{size} ({tokens} image tokens), prompts {lens} tokens, {dtype}; floor {floor['ms']:.1f} ms"
    )
    results, baseline, base_ms = {}, None, None
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.no_grad():
        for label, fn in rows.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                out, first, times = timed(fn, device, warmup=2, iters=args.iters)
            except Exception as err:  # noqa: BLE001 - report the row and go on
                print(f"{label}: {one_line(err, typed=True)}")
                continue
            ms = statistics.median(times)
            peak = (
                (torch.cuda.max_memory_allocated(device) - weights) / 2**30 if device.type == "cuda" else None
            )
            if baseline is None:
                baseline, base_ms = out, ms
            results[label] = {
                "ms": ms,
                "x_floor": ms / floor["ms"],
                "speedup_vs_pipeline_way": base_ms / ms,
                "max_abs": max_abs(out, baseline),
                "peak_gib": peak,
                "first_s": first,
            }
    print_table(
        [("row", 40), ("ms", 9), ("x floor", 8), ("vs diffusers", 12), ("max abs", 10), ("GiB", 6)],
        [
            [
                label,
                r["ms"],
                f"{r['x_floor']:.2f}",
                f"{r['speedup_vs_pipeline_way']:.2f}x",
                f"{r['max_abs']:.2e}",
                r["peak_gib"],
            ]
            for label, r in results.items()
        ],
    )
    if args.profile:
        with torch.no_grad():
            print_kernel_breakdown(lambda: mmgen_packed(auto, layout), device, top=args.profile)
    write_json(
        args.json, {"floor": floor, "rows": results, "size": size, "text_lens": lens, "dtype": str(dtype)}
    )


if __name__ == "__main__":
    main()
