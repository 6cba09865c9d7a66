"""The whole Wan pipeline under GPU memory caps (issue 18): the plan mmgen picks for each budget, its
seconds per denoising step against the resident pipeline, and the peak memory of every stage.

Run from the repository root on one CUDA GPU with diffusers importable (benchmarks/README.md):

    python3 benchmarks/offload_pipeline.py --model 1.3b --caps 8,4            # Wan2.1-1.3B 480x832x81, ~80 s
    python3 benchmarks/offload_pipeline.py --model 14b --caps 24,12,8         # Wan2.1-14B 720x1280x81, ~5 min
    python3 benchmarks/offload_pipeline.py --tiny                              # CPU smoke run of the harness

Components: wan_models.build_parts (UMT5-XXL-size encoder, the DiT of --model, the Wan2.1 VAE in
--vae-dtype; random weights made on the GPU, then moved to host memory), UniPC, CFG 5, --steps steps.
Per cap the pipeline runs with gpu_memory_gb = cap under torch.cuda.set_per_process_memory_fraction
(the caching allocator refuses to grow past it: what the process allocates, not the CUDA context), and
the memory planner picks the plan (layer offload of the DiT blocks from pinned host memory,
sequential CFG, FFN / block token chunks, the decode mode). Then the resident pipeline (no cap), the
reference of every ratio: the same latents sha256 means offload, sequential CFG and chunks were exact;
the frames' PSNR against resident shows what a lossy decode mode moved.

Answered and removed (git history at commit ea73d1a, benchmarks/offload_step.py; RESULTS.md 9, 9b):
the DiT step alone under caps, diffusers' group offloading (block_level / leaf_level) beside it, the
resident step with a plan's chunks, the pinned host-to-device rate and byte floor.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    environment_header,
    print_table,
    write_json,
)
from wan_models import add_model_args, build_parts, mmgen_pipeline  # noqa: E402

from mmgen.errors import one_line  # noqa: E402
from mmgen.render.metrics import psnr_uint8  # noqa: E402

GIB = 2**30
PROMPT = "a red fox running through a snowy forest at sunset"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--caps", default="8,4", help="GiB caps, comma-separated")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per call")
    parser.add_argument("--attention", default="auto", help="mmgen attention backend on CUDA")
    parser.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--no-resident", action="store_true", help="skip the uncapped resident row")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


def capped(device: torch.device, cap_gib: float | None) -> None:
    """Cap (or uncap) what the caching allocator may hold on `device`; frees cached blocks first."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if cap_gib is None else min(1.0, cap_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device.index or torch.cuda.current_device())


def on_host(parts):
    """The parts with the diffusers copies dropped and mmgen's weights in host memory (the plan places them)."""
    for module in (parts.model, parts.encoder, parts.vae):
        module.to("cpu")
    return replace(parts, reference=None, hf_encoder=None)


def plan_text(result) -> str:
    plan = result.args.get("memory_plan") or {}
    chunks = "".join(f", {name} {plan[name]}" for name in ("ffn_chunk", "block_chunk") if plan.get(name))
    lossy = " (lossy)" if plan.get("lossy") else ""
    return f"{plan.get('offload')}, cfg {plan.get('cfg')}{chunks}, decode {plan.get('decode')}{lossy}"


def run(pipe, cap: float | None, device: torch.device, args) -> dict:
    """One pipeline call under `cap` GiB (None: uncapped, resident): its row as a dict."""
    capped(device, cap)
    row = {"cap": "none" if cap is None else f"{cap:g}"}
    try:
        result = pipe(
            PROMPT,
            seed=1,
            gpu_memory_gb=cap if device.type == "cuda" else None,  # the caps only mean something on a GPU
            attention_backend=args.attention if device.type == "cuda" else "sdpa",
            progress=False,
        )
    except Exception as err:  # an OOM under one cap must not lose the other rows
        row["error"] = one_line(err, typed=True)
        print(f"cap {row['cap']}: {row['error']}", flush=True)
        return row
    finally:
        capped(device, None)
    row.update(
        plan=plan_text(result),
        step_s=result.timings["denoise"] / args.steps,
        timings=dict(result.timings),
        peak_gib=dict(result.memory),
        latents_sha256=result.latents_sha256,
        frames=result.frames,
    )
    print(f"cap {row['cap']}: {row['plan']}; {row['step_s']:.3f} s/step", flush=True)
    return row


def print_rows(rows: list[dict]) -> None:
    resident = next((r for r in rows if r["cap"] == "none" and "error" not in r), None)
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["cap"], r["error"], "-", "-", "-", "-", "-"))
            continue
        ratio = f"{r['step_s'] / resident['step_s']:.3f}" if resident else "-"
        same = "-" if resident is None else "=" if r["latents_sha256"] == resident["latents_sha256"] else "!="
        quality = (
            "-" if resident is None or r is resident else f"{psnr_uint8(r['frames'], resident['frames']):.1f}"
        )
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items() if k != "total")
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in r["peak_gib"].items()) or "n/a"
        cells.append(
            (r["cap"], r["plan"], f"{r['step_s']:.3f}", ratio, same, quality, f"{stages}; peak GiB {peaks}")
        )
    columns = [("cap GiB", 7), ("plan", 44), ("s/step", 7), ("x res", 6), ("latents", 7), ("PSNR", 5)]
    print_table(columns + [("stage s; peak GiB per stage", 0)], cells)


def main() -> None:
    args = parse_args()
    device = bench_device(args.tiny)
    caps = [float(c) for c in args.caps.split(",") if c.strip()]
    tick = time.perf_counter()
    parts = on_host(build_parts(args, device, vae_dtype=getattr(torch, args.vae_dtype)))
    print(f"parts built in {time.perf_counter() - tick:.1f} s, weights in host memory", flush=True)
    pipe = mmgen_pipeline(parts, args.steps, device=device)
    rows = []
    try:  # resident last: nothing of the capped rows is left to evict
        for cap in caps + ([] if args.no_resident else [None]):
            rows.append(run(pipe, cap, device, args))
    except KeyboardInterrupt:
        print("INTERRUPTED: the table below holds the rows measured so far", flush=True)
    height, width, frames = parts.video
    print(f"\n{environment_header(device)}")
    print(f"whole pipeline {height}x{width}x{frames}, {args.steps} steps, CFG 5, VAE {args.vae_dtype}")
    print_rows(rows)
    write_json(
        args.json,
        {"video": parts.video, "rows": [{k: v for k, v in r.items() if k != "frames"} for r in rows]},
    )


if __name__ == "__main__":
    main()
