"""The lossy settings end to end (issue 20): the whole mmgen pipeline per setting, against lossless.

Run from the repository root on a CUDA machine (benchmarks/README.md: the GPU set-up):

    python3 benchmarks/lossy_e2e.py --model 1.3b --steps 50       # ~4 min on an H100
    python3 benchmarks/lossy_e2e.py --model 14b --steps 8 --settings lossless,fast --vae-dtype bfloat16 \\
        --warmup-steps 1                                           # ~6 min on an H100
    python3 benchmarks/lossy_e2e.py --tiny --steps 6               # CPU smoke run of the harness

The pipeline is mmgen's WanT2VPipeline over the components wan_models.build_parts makes: a
UMT5-XXL-size text encoder, the DiT of --model and the Wan2.1 VAE, random weights built on the
device (DiT and encoder bf16; VAE float32 unless --vae-dtype), UniPC (flow shift 3), CFG 5, FA3,
eager blocks on every side. Each setting: one untimed call of --warmup-steps steps (start-up,
kernel selection, Triton JIT, FP8 weight copies), then one timed call of --steps steps.

Printed: per setting, the DiT batch rows run (2 per guided step, 1 per CFG-truncated step, 0 per
cached step), the pipeline's stage seconds (text_encode, denoise, decode; each synchronized), the
call's wall seconds, the speed-up over lossless end to end and of the denoise stage alone, and the
PSNR of the uint8 frames and the relative L2 error of the final latents against lossless (random
weights: how far the numbers move, not picture quality; `mmgen ab` on the default model gives that,
benchmarks/lossy_ledger.py tabulates it).

Settings (--settings, comma-separated; default all): lossless, fp8 (linears of the kinds
fp8_layers_for picks for the width + e4m3 self-attention), the presets fast and fastest as shipped
(accel=; their FP8 parts only where native: result.args['accel_skipped'] is printed). On CPU (--tiny)
the explicit FP8 setting runs emulated (slow; the presets skip FP8 there): only the harness is tested.
Answered and removed (git history, RESULTS.md 12e): the per-step FP8 table and the candidate `fast`
settings (step_cache 2.0 with CFG 0.8 became `fast`).
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
    print_table,
    relative_error,
    report_on_sigterm,
    versions,
    write_json,
)
from wan_models import add_model_args, build_parts, mmgen_pipeline  # noqa: E402

from mmgen.errors import one_line  # noqa: E402
from mmgen.render.metrics import psnr_uint8  # noqa: E402

FP8 = {"fp8_linear": True, "fp8_attention": True}
# label -> the pipeline's keyword arguments; "lossless" is the reference of every ratio.
SETTINGS = {"lossless": {}, "fp8": FP8, "fast": {"accel": "fast"}, "fastest": {"accel": "fastest"}}
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
                rows.append((label, *(["-"] * 10), one_line(err, typed=True)[:60]))
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
                "psnr_db": psnr_uint8(result.frames, base.frames) if result is not base else None,
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
    write_json(
        args.json,
        {
            "device": device_name(device),
            "versions": versions(),
            "video": list(parts.video),
            "steps": args.steps,
            "vae_dtype": args.vae_dtype,
            "rows": results,
        },
    )


if __name__ == "__main__":
    main()
