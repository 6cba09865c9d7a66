"""What a LoRA costs per Wan step, unfused (the default kernels) and fused, at each rank; and what it
costs to apply and remove. Random bf16 weights, one GPU.

    python3 benchmarks/lora_step.py                                    # Wan2.1-1.3B 480x832x81, CFG batch 2
    python3 benchmarks/lora_step.py --model 14b --batch 1 --ranks 32   # Wan2.1-14B 720x1280x81 (~9.5 s a call)
    python3 benchmarks/lora_step.py --tiny --attention flash:reference # CPU smoke run (tiny sizes)

One step of mmgen's WanDiT with stacked q/k/v (batch --batch: 2 = one CFG step), attention --attention,
with a LoRA on every block Linear (self/cross q, k, v, o and both FFN layers, as the lightx2v
distillation LoRAs cover) at each rank: unfused (LowRankLinear beside the weight, kernel 'auto':
"concat" where a producer writes padded rows, else "fused-add"; mmgen/layers/low_rank.py) and fused
(merged). ms = median of --iters CUDA-event timings after --warmup calls; overhead against the
no-LoRA row (targets: <= 3% unfused at rank 32, 0 fused). Apply / remove seconds: apply_loras
(unfused: the modules swapped, the concat weights packed; fused: merged in float32) and remove().
--concat-aligns: extra rows with the concat kernel's spare columns rounded to other multiples (the
open question of RESULTS.md 10c). Answered and removed (git history at commit ea73d1a; RESULTS.md
10-10c): the bytes model, the per-linear and attention-output tables, the in-place mm check, the
A/B of the unfused kernels and the distill-4step end-to-end table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    environment_header,
    synchronize,
    timed,
)
from wan_models import MODELS, TINY, TINY_VIDEO, make_inputs, random_dit  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.attention.selection import BACKEND_NAMES  # noqa: E402
from mmgen.errors import one_line  # noqa: E402
from mmgen.layers.low_rank import CONCAT_ALIGN  # noqa: E402
from mmgen.lora import LoRARequest, apply_loras, parse_lora  # noqa: E402
from mmgen.lora.names import takes_padded_input  # noqa: E402
from mmgen.lora.pack import pack_concat, unpack_concat  # noqa: E402
from mmgen.lora.readers import LoRAFile  # noqa: E402
from mmgen.models.wan import WanDiT  # noqa: E402

LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0") + (
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2",
)  # fmt: skip


def synthetic_lora(model: WanDiT, rank: int, device: torch.device) -> LoRAFile:
    """A diffusers-format LoRA of `rank` on every block Linear (bf16 on the device), read like a file."""
    gen = torch.Generator(device).manual_seed(rank)
    params = dict(model.named_parameters())
    state = {}
    kw = dict(device=device, dtype=torch.bfloat16, generator=gen)
    for index in range(model.config.num_layers):
        for layer in LINEARS:
            out_dim, in_dim = params[f"blocks.{index}.{layer}.weight"].shape
            prefix = f"transformer.blocks.{index}.{layer}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, **kw) * in_dim**-0.5
            state[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, **kw) * 0.01
    return LoRAFile(Path(f"rank{rank}"), f"synthetic-rank-{rank}", parse_lora(state, source=f"rank{rank}"))


def repack(applied, align: int) -> None:
    """Pack the applied LoRAs' concat groups again with spare columns rounded up to `align`."""
    for index, (expert, holders) in enumerate(applied.packed):
        unpack_concat(expert, holders)
        applied.packed[index] = (expert, pack_concat(expert, takes_padded_input, align))


def seconds(fn, device: torch.device) -> tuple[object, float]:
    """fn() and its wall seconds, the device synchronized on both sides."""
    synchronize(device)
    tick = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - tick


def step_ms(model: WanDiT, attention, inputs, device: torch.device, args) -> float | str:
    """Median ms of one step, or why it failed (one failing row must not lose the others)."""
    try:
        with torch.no_grad():
            _, _, times = timed(
                lambda: model(*inputs, attention=attention), device, warmup=args.warmup, iters=args.iters
            )
    except Exception as err:
        return f"failed: {one_line(err, typed=True)[:80]}"
    return statistics.median(times)


def step_table(model: WanDiT, attention, inputs, device: torch.device, args) -> list[str]:
    """Markdown rows: no LoRA, then per rank unfused (+ each --concat-aligns) and fused."""
    base = step_ms(model, attention, inputs, device, args)
    if isinstance(base, str):
        raise SystemExit(f"the step without a LoRA {base}")

    def cells(ms: float | str) -> str:
        return f"{ms} | -" if isinstance(ms, str) else f"{ms:.1f} | {100.0 * (ms / base - 1.0):+.2f}%"

    lines = ["| LoRA | mode | ms / step | overhead | apply s | remove s |", "|---|---|---|---|---|---|"]
    lines.append(f"| none | - | {base:.1f} | - | - | - |")
    print(lines[-1], flush=True)
    for rank in args.ranks:
        lora = synthetic_lora(model, rank, device)
        loras = [(LoRARequest(lora.path, 1.0), lora)]
        for mode in ("unfused", "fused"):
            applied, apply_s = seconds(lambda m=mode, ls=loras: apply_loras([model], ls, mode=m), device)
            rows = [
                (
                    f"{mode}{' auto' if mode == 'unfused' else ''}",
                    step_ms(model, attention, inputs, device, args),
                )
            ]
            for align in args.concat_aligns if mode == "unfused" else ():
                repack(applied, align)
                rows.append((f"unfused auto, concat spare columns to {align}", step_ms(model, attention, inputs, device, args)))  # fmt: skip
            _, remove_s = seconds(applied.remove, device)
            for label, ms in rows:
                lines.append(f"| rank {rank} | {label} | {cells(ms)} | {apply_s:.3f} | {remove_s:.3f} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness (tiny config)")
    parser.add_argument("--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[32, 128])
    parser.add_argument("--batch", type=int, choices=(1, 2), default=2, help="2: one CFG step (default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per row")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per row (14B: ~10 s each)")
    parser.add_argument("--attention", default="auto", choices=BACKEND_NAMES, help="attention backend")
    parser.add_argument(
        "--concat-aligns",
        type=lambda s: [int(a) for a in s.split(",") if a],
        default=[],
        help=f"extra unfused rows with the concat spare columns rounded to these (multiples of {CONCAT_ALIGN})",
    )
    args = parser.parse_args()
    if any(align <= 0 or align % CONCAT_ALIGN for align in args.concat_aligns):
        parser.error(f"--concat-aligns {args.concat_aligns}: positive multiples of {CONCAT_ALIGN}")
    device = bench_device(args.tiny)
    config, video = (TINY, TINY_VIDEO) if args.tiny else MODELS[args.model]
    if args.tiny:
        args.warmup, args.iters = 1, 2
    tick = time.perf_counter()
    model = random_dit(config, device).fuse_projections()  # q/k/v stacked, as the pipeline runs it
    step = make_inputs(config, video, device)
    inputs = (step.latents[: args.batch], step.timestep[: args.batch], step.text[: args.batch])
    attention = select_attention(
        args.attention, device=device, dtype=torch.bfloat16, head_dim=config.attention_head_dim
    )
    print(
        f"model built in {time.perf_counter() - tick:.1f} s; attention {attention.name}:{attention.provider}"
    )
    lines = step_table(model, attention, inputs, device, args)
    print("\n" + environment_header(device))
    print(
        f"Wan {config.dim}d x {config.num_layers} layers, video {video[0]}x{video[1]}x{video[2]}, batch "
        f"{args.batch}{' (one CFG step)' if args.batch == 2 else ''}, bf16, median of {args.iters} after {args.warmup}"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
