"""The whole Wan text-to-video pipeline, mmgen against diffusers' WanPipeline, same components.

Run from the repository root on a CUDA machine with diffusers:

    python3 benchmarks/pipeline_e2e.py --steps 50        # Wan2.1-T2V-1.3B, 480x832x81
    python3 benchmarks/pipeline_e2e.py --tiny --steps 2  # CPU smoke run of the harness (tiny config)

Components: a UMT5-XXL-size text encoder (random weights, shared by both), the Wan2.1 VAE (random
weights, one instance for both), UniPC, the DiT with random bf16 weights in both (benchmarks/
wan_models.py). mmgen runs with --attention and its compile flag (one untimed 1-step call compiles
first); diffusers with its default attention, cond/uncond as two calls as WanPipeline does.
Printed: mmgen's total and per-stage seconds (text_encode, denoise, decode) and ms per step,
diffusers' total, the speedup and the PSNR of mmgen's frames against diffusers'.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    psnr,
    synchronize,
    versions,
    write_json,
)
from wan_models import RANDOM, TINY, add_model_args, build_models, model_and_video  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps")
    parser.add_argument("--attention", default="flash:fa3", help="mmgen attention backend (BACKEND_NAMES)")
    parser.add_argument("--no-compile", action="store_true", help="run mmgen's blocks eagerly")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the blocks")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


@dataclass(frozen=True)
class Parts:
    """The pipeline components both sides share (random weights), and the video they make."""

    reference: torch.nn.Module  # diffusers WanTransformer3DModel, same tensors as `model`
    model: torch.nn.Module  # mmgen WanDiT
    encoder: torch.nn.Module  # mmgen UMT5Encoder
    hf_encoder: torch.nn.Module  # transformers UMT5EncoderModel, same weights
    tokenizer_dir: Path
    vae: torch.nn.Module  # diffusers AutoencoderKLWan
    scheduler: object  # diffusers UniPCMultistepScheduler (flow shift 3)
    video: tuple[int, int, int]  # height, width, frames


def build_parts(
    args: argparse.Namespace, device: torch.device, *, vae_dtype: torch.dtype = torch.float32
) -> Parts:
    """A UMT5-XXL-size text encoder, the DiT of --model (or --tiny) and the Wan2.1 VAE, random weights on `device`.

    Everything is built directly on the device (a 14B DiT built on the CPU first would take minutes);
    the DiT and text encoder in bf16, the VAE in `vae_dtype` (float32 as diffusers' Wan pipelines run it).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config as HFUMT5Config
    from transformers import UMT5EncoderModel

    from mmgen.default_model import VAE, WORDS
    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.loading.tokenizer import build_word_tokenizer
    from mmgen.models.umt5 import UMT5Config, UMT5Encoder

    config, video = model_and_video(args)
    if args.tiny:
        text_config = UMT5Config(
            vocab_size=512, d_model=TINY.text_dim, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
        vae_config = {
            **copy.deepcopy(VAE),
            "z_dim": 16,
            "latents_mean": [0.0] * 16,
            "latents_std": [1.0] * 16,
        }
    else:
        # UMT5-XXL, the text encoder of every Wan2.1 model
        text_config = UMT5Config(
            vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64
        )
        vae_config = {}  # diffusers' defaults are the Wan2.1 VAE
    reference, model = build_models(config, device)
    workdir = Path(tempfile.mkdtemp(prefix="mmgen-bench-"))
    build_word_tokenizer(list(WORDS), workdir / "tokenizer", model_max_length=config.text_len)

    torch.manual_seed(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf_encoder = UMT5EncoderModel(HFUMT5Config(**text_config.to_hf_config())).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.device("meta"):
        encoder = UMT5Encoder(text_config)
    tensors = {
        k: (v, RANDOM) for k, v in hf_encoder.state_dict().items() if k != "encoder.embed_tokens.weight"
    }
    load_into_module(encoder, tensors, source=RANDOM, dtype=torch.bfloat16, device=device)
    encoder.eval()
    with torch.device(device):
        vae = AutoencoderKLWan(**vae_config).eval()
    if vae_dtype != torch.float32:
        vae = vae.to(vae_dtype)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return Parts(reference, model, encoder, hf_encoder, workdir / "tokenizer", vae, scheduler, video)


def mmgen_pipeline(parts: Parts, steps: int):
    """mmgen's WanT2VPipeline over `parts`, defaulting to their video size and `steps` steps."""
    from mmgen.loading.tokenizer import TextTokenizer
    from mmgen.loading.wan_components import GenerationDefaults
    from pipelines.wan_t2v import WanT2VPipeline

    height, width, frames = parts.video
    defaults = GenerationDefaults(height=height, width=width, num_frames=frames, num_inference_steps=steps)
    tokenizer = TextTokenizer.from_dir(parts.tokenizer_dir)
    return WanT2VPipeline(
        parts.model, parts.encoder, tokenizer, parts.vae, parts.scheduler, defaults=defaults
    )


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
    quality = psnr(result.frames, frames_theirs)
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
