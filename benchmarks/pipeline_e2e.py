"""The whole Wan text-to-video pipeline, mmgen against diffusers' WanPipeline, same components.

Run from the repository root on a CUDA machine with diffusers:

    python3 benchmarks/pipeline_e2e.py --steps 50        # Wan2.1-T2V-1.3B, 480x832x81
    python3 benchmarks/pipeline_e2e.py --tiny --steps 2  # CPU smoke run of the harness (tiny config)

Components: a UMT5-XXL-size text encoder (random weights, shared by both), the Wan2.1 VAE (random
weights, one instance for both), UniPC, the DiT with random bf16 weights in both
(`wan_models.build_parts`). mmgen runs with --attention and its compile flag (one untimed 1-step call compiles
first); diffusers with its default attention, cond/uncond as two calls as WanPipeline does.
Printed: mmgen's total and per-stage seconds (text_encode, denoise, decode) and ms per step,
diffusers' total, the speedup and the PSNR of mmgen's frames against diffusers'.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    synchronize,
    versions,
    write_json,
)
from wan_models import add_model_args, build_parts, mmgen_pipeline  # noqa: E402

from mmgen.render.metrics import psnr_uint8  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps")
    parser.add_argument("--attention", default="flash:fa3", help="mmgen attention backend (BACKEND_NAMES)")
    parser.add_argument("--no-compile", action="store_true", help="run mmgen's blocks eagerly")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the blocks")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


def pipeline_mode(args: argparse.Namespace, device: torch.device) -> dict:
    """Whole pipeline (text encode, denoise, VAE decode) for mmgen and diffusers' WanPipeline, same components."""
    import numpy as np
    from diffusers import WanPipeline
    from transformers import AutoTokenizer

    parts = build_parts(args, device)
    height, width, frames = video = parts.video
    ours = mmgen_pipeline(parts, args.steps)
    model = parts.model
    theirs = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(parts.tokenizer_dir),
        text_encoder=parts.hf_encoder,
        vae=parts.vae,
        scheduler=copy.deepcopy(parts.scheduler),
        transformer=parts.reference,
    )
    theirs.set_progress_bar_config(disable=True)
    prompt, negative = "a red fox running through a snowy forest at sunset", "blurry dark"
    noise = torch.randn(ours.latents_shape(height, width, frames), generator=torch.Generator().manual_seed(7))
    attention = args.attention if device.type == "cuda" else "sdpa"
    compile_blocks = not args.no_compile
    if compile_blocks:
        if args.compile_backend != "inductor":  # the pipeline's compile=True uses the default backend
            model.compile_blocks(backend=args.compile_backend)
        # one untimed short call compiles the blocks (the pipeline's compile flag) outside the timed run
        ours(
            prompt,
            negative,
            latents=noise,
            num_inference_steps=1,
            attention_backend=attention,
            progress=False,
            compile=True,
        )
    common = dict(
        height=height, width=width, num_frames=frames, num_inference_steps=args.steps, guidance_scale=5.0
    )

    synchronize(device)
    tick = time.perf_counter()
    result = ours(
        prompt,
        negative,
        latents=noise,
        attention_backend=attention,
        progress=False,
        compile=compile_blocks,
        **common,
    )
    ours_s = time.perf_counter() - tick
    with torch.no_grad():
        synchronize(device)
        tick = time.perf_counter()
        frames_theirs = theirs(
            prompt, negative, latents=noise.clone().to(device), output_type="np", **common
        ).frames[0]
        synchronize(device)
        theirs_s = time.perf_counter() - tick
    frames_theirs = np.round(np.clip(frames_theirs, 0, 1) * 255).astype(np.uint8)
    quality = psnr_uint8(result.frames, frames_theirs)
    print("\n" + environment_header(device))
    print(
        f"pipeline {height}x{width}x{frames}, {args.steps} steps, CFG 5.0, mmgen attention {attention}, "
        f"compiled {result.args['compile']} (the pipeline's compile flag)"
    )
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    print(
        f"mmgen     total {ours_s:7.2f} s ({stages}; {result.timings['denoise'] / args.steps * 1e3:.0f} ms/step)"
    )
    print(f"diffusers total {theirs_s:7.2f} s (WanPipeline, default attention, cond/uncond as two calls)")
    print(
        f"speedup {theirs_s / ours_s:.2f}x; frames {result.frames.shape}; PSNR mmgen vs diffusers {quality:.2f} dB"
    )
    return {
        "device": device_name(device),
        "versions": versions(),
        "video": video,
        "steps": args.steps,
        "mmgen_s": ours_s,
        "mmgen_timings": result.timings,
        "diffusers_s": theirs_s,
        "psnr_db": quality,
    }


def main() -> None:
    args = parse_args()
    write_json(args.json, pipeline_mode(args, bench_device(args.tiny)))


if __name__ == "__main__":
    main()
