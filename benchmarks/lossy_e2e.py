"""The lossy settings end to end (issue 20): the whole mmgen pipeline per setting, against lossless.

Run from the repository root on a CUDA machine (bundles as in /work/shared/GPU.md):

    python3 benchmarks/lossy_e2e.py --model 1.3b --steps 50       # ~4.5 min on an H100 (see below)
    python3 benchmarks/lossy_e2e.py --model 14b --steps 8 --settings lossless,fast --vae-dtype bfloat16 \\
        --warmup-steps 1 --step-iters 0     # ~6 min on an H100 (its step table: lossy_step.py --fp8-step --fp8-short)
    python3 benchmarks/lossy_e2e.py --tiny --steps 6               # CPU smoke run of the harness

The pipeline is mmgen's WanT2VPipeline over the components benchmarks/pipeline_e2e.py builds: a
UMT5-XXL-size text encoder, the DiT of --model and the Wan2.1 VAE, random weights built on the
device (DiT and encoder bf16; VAE float32 unless --vae-dtype), UniPC (flow shift 3), CFG 5, FA3,
eager blocks on every side. Each setting: one untimed call of --warmup-steps steps (start-up,
kernel selection, Triton JIT, FP8 weight copies), then one timed call of --steps steps.

Printed: per setting, the DiT batch rows run (2 per guided step, 1 per CFG-truncated step, 0 per
cached step), the pipeline's stage seconds (text_encode, denoise, decode; each synchronized), the
call's wall seconds, the speed-up over lossless end to end and of the denoise stage alone, and the
PSNR of the uint8 frames and the relative L2 error of the final latents against lossless (random
weights: how far the numbers move, not picture quality; `mmgen ab` on the default model gives that).
Then one CFG step of the DiT (batch 2, eager, q/k/v unstacked as the pipeline runs it) with bf16,
FP8 linears, FP8 attention and both: the per-step speed-up of each FP8 option (step caching and CFG
truncation save whole rows of the loop, which the first table counts).

Settings (--settings, comma-separated; default all): lossless, fp8 (linears of the kinds
fp8_layers_for picks for the width + e4m3 self-attention), the presets fast and fastest as shipped
(accel=; their FP8 parts only where native: result.args['accel_skipped'] is printed), and the
candidate stronger `fast` settings `sc<T>/cfg<F>` = step_cache T + cfg_truncation F + both FP8
options, defined here only (not presets) so one run can choose between them. On CPU (--tiny) the
explicit FP8 settings run emulated (slow; the presets skip FP8 there): only the harness is tested.

Budget (H100, 1.3B 480x832x81, 50 steps; from RESULTS.md 12b-12d): lossless ~44 s denoise + ~3.5 s
decode; fp8 ~41 s; fast ~21 s; fastest ~16 s; each candidate ~17-18 s; warm-ups 6 x ~6 s; step
table ~15 s; build and imports ~60 s: about 4.5 minutes. 14B 720p: ~20 s per lossless CFG step, so 50
steps do not fit one call; the 14B rows are an 8-step loop, measured as such (caching saves a smaller
share of few steps: `fast` runs 9 of 16 rows at 8 steps against 46 of 100 at 50).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    one_line,
    print_table,
    psnr,
    relative_error,
    report_on_sigterm,
    versions,
    write_json,
)
from lossy_step import STEP_COLUMNS, step_table  # noqa: E402
from pipeline_e2e import build_parts, mmgen_pipeline  # noqa: E402
from wan_models import add_model_args  # noqa: E402

FP8 = {"fp8_linear": True, "fp8_attention": True}
# label -> the pipeline's keyword arguments; "lossless" is the reference of every ratio. The sc*
# rows are candidate stronger `fast` settings: DiT rows of 100 at 50 steps on the random 1.3B model
# (from the timestep-embedding schedule) 2.0/0.8 -> 38, 2.0/0.7 -> 36, against fast's 46 and
# fastest's 28. (1.5/0.5, 39 rows, lost to 2.0/0.8 on the default model's ledger: dropped.)
SETTINGS = {
    "lossless": {},
    "fp8": FP8,
    "fast": {"accel": "fast"},
    "fastest": {"accel": "fastest"},
    "sc2.0/cfg0.8": {"step_cache": 2.0, "cfg_truncation": 0.8, **FP8},
    "sc2.0/cfg0.7": {"step_cache": 2.0, "cfg_truncation": 0.7, **FP8},
}
PROMPT, NEGATIVE = "a red fox running through a snowy forest at sunset", "blurry dark"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps of each timed call")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of each setting's untimed call")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated, lossless first (default all: {','.join(SETTINGS)})",
    )
    parser.add_argument("--attention", default="flash:fa3", help="mmgen attention backend on CUDA")
    parser.add_argument(
        "--vae-dtype", choices=("float32", "bfloat16"), default="float32", help="the VAE's dtype"
    )
    parser.add_argument("--step-warmup", type=int, default=1, help="step table: untimed calls per row")
    parser.add_argument(
        "--step-iters", type=int, default=3, help="step table: timed calls per row (0: no table)"
    )
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    args = parser.parse_args()
    names = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names or names[0] != "lossless":
        parser.error(f"--settings {args.settings!r}: lossless first, then any of {', '.join(SETTINGS)}")
    args.settings = names
    return args


def dit_rows(result, steps: int) -> int:
    """DiT batch rows the call ran: 0 per cached step, 2 per guided step, 1 per CFG-truncated step."""
    from pipelines.step_cache import guided_steps

    reused = set(result.args.get("step_cache_reused", ()))
    keep = guided_steps(result.args.get("cfg_truncation"), steps)
    return sum(0 if i in reused else (2 if i < keep else 1) for i in range(steps))


def main() -> None:
    args = parse_args()
    report_on_sigterm()
    device = bench_device(args.tiny)
    parts = build_parts(args, device, vae_dtype=getattr(torch, args.vae_dtype))
    pipe = mmgen_pipeline(parts, args.steps)
    height, width, frames = parts.video
    noise = torch.randn(pipe.latents_shape(height, width, frames), generator=torch.Generator().manual_seed(7))
    attention = args.attention if device.type == "cuda" else "sdpa"

    def call(steps: int, settings: dict):
        return pipe(
            PROMPT,
            NEGATIVE,
            latents=noise,
            num_inference_steps=steps,
            guidance_scale=5.0,
            attention_backend=attention,
            progress=False,
            **settings,
        )

    rows, results, exact = [], [], None
    try:
        for label in args.settings:
            settings = SETTINGS[label]
            try:
                call(args.warmup_steps, settings)
                tick = time.perf_counter()
                result = call(args.steps, settings)
                wall = time.perf_counter() - tick  # frames are on the host: the GPU work is done
            except Exception as err:  # noqa: BLE001 - the row says why (e.g. no FA3 for FP8 attention)
                rows.append((label, *(["-"] * 10), one_line(err)[:60]))
                if exact is None:
                    raise
                continue
            timings = result.timings
            if exact is None:
                exact = {"result": result, "wall": wall, "denoise": timings["denoise"]}
            base = exact["result"]
            row = {
                "setting": label,
                "kwargs": settings,
                "dit_batch_rows": dit_rows(result, args.steps),
                "timings": dict(timings),
                "wall_s": wall,
                "speedup_e2e": exact["wall"] / wall,
                "speedup_denoise": exact["denoise"] / timings["denoise"],
                "psnr_db": psnr(result.frames, base.frames) if result is not base else None,
                "latents_rel_error": relative_error(result.latents, base.latents),
                "fp8_linear_layers": result.args.get("fp8_linear_layers", []),
                "fp8_attention": bool(result.args.get("fp8_attention")),
                "accel_skipped": result.args.get("accel_skipped", {}),
                "step_cache_reused": result.args.get("step_cache_reused", []),
            }
            results.append(row)
            fp8 = "+".join(
                part for part, on in (("lin", row["fp8_linear_layers"]), ("attn", row["fp8_attention"])) if on
            )
            rows.append(
                (
                    label,
                    f"{row['dit_batch_rows']}/{2 * args.steps}",
                    fp8 or "-",
                    f"{timings['text_encode']:.2f}",
                    f"{timings['denoise']:.2f}",
                    f"{timings['decode']:.2f}",
                    f"{wall:.2f}",
                    f"{row['speedup_e2e']:.2f}x",
                    f"{row['speedup_denoise']:.2f}x",
                    "-" if row["psnr_db"] is None else f"{row['psnr_db']:.2f}",
                    f"{row['latents_rel_error']:.4f}",
                    "; ".join(sorted(row["accel_skipped"])) or "-",
                )
            )
            del result
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far")

    step_rows, step_results = [], []
    if args.step_iters > 0:
        from mmgen.attention import select_attention
        from mmgen.layers.fp8_linear import fp8_layers_for

        model = parts.model
        impl = select_attention(
            attention, device=device, dtype=model.dtype, head_dim=model.config.attention_head_dim
        )
        kinds = fp8_layers_for(model.config.dim)
        settings = [
            ("bf16", None, False),
            ("fp8 linear", kinds, False),
            ("fp8 attention", None, True),
            ("fp8 linear + attention", kinds, True),
        ]
        step_rows, step_results = step_table(
            model,
            parts.video,
            impl,
            device,
            settings,
            torch.Generator().manual_seed(5),
            warmup=args.step_warmup,
            iters=args.step_iters,
        )

    print("\n" + environment_header(device))
    config = parts.model.config
    print(
        f"whole pipeline {height}x{width}x{frames}, {args.steps} steps (warm-up calls {args.warmup_steps}), "
        f"CFG 5, UniPC, attention {attention}, eager blocks; DiT dim {config.dim} x {config.num_layers} "
        f"layers; text encoder UMT5 d {parts.encoder.config.d_model}; VAE {args.vae_dtype}"
    )
    print(
        "e2e = the call's wall seconds; ratios over lossless; PSNR / latents error vs lossless (random weights)"
    )
    print_table(
        [
            ("setting", 14),
            ("DiT rows", 9),
            ("fp8", 8),
            ("text_s", 7),
            ("denoise_s", 9),
            ("decode_s", 8),
            ("e2e_s", 7),
            ("e2e_x", 6),
            ("denoise_x", 9),
            ("psnr_dB", 8),
            ("latents_rel", 11),
            ("accel_skipped", 14),
        ],
        rows,
    )
    if step_rows:
        print(
            f"\none CFG step (DiT batch 2, eager, q/k/v unstacked as in the pipeline), median of "
            f"{args.step_iters} after {args.step_warmup} untimed; FP8 linears {sorted(kinds)}; error = "
            "relative L2 of the DiT output vs bf16"
        )
        print_table(STEP_COLUMNS, step_rows)
    write_json(
        args.json,
        {
            "device": device_name(device),
            "versions": versions(),
            "video": list(parts.video),
            "steps": args.steps,
            "vae_dtype": args.vae_dtype,
            "rows": results,
            "step_rows": step_results,
        },
    )


if __name__ == "__main__":
    main()
