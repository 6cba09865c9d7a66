"""Qwen-Image end to end: mmgen's QwenImagePipeline against diffusers' QwenImagePipeline, same GPU, same weights.

Run from the repository root on a CUDA machine with diffusers and transformers:

    python3 benchmarks/qwen_image_e2e.py                  # 1328x1328, 50 steps, true CFG 4.0
    python3 benchmarks/qwen_image_e2e.py --tiny --steps 2  # CPU smoke run of the harness

Random bf16 weights at the real configs (20B transformer, Qwen2.5-VL-7B text encoder, the VAE) are
built once and shared by both pipelines (one copy on the GPU); the tokenizer is the tests' tiny
byte-level Qwen2 tokenizer (token ids differ from Qwen's, the work per token does not). Each
pipeline gets the same prompt, negative prompt " " (true CFG on, as a user runs it), seed and size;
one warm-up call of 2 steps each, then one timed call. Printed: seconds per image (text encoding,
denoise, decode), mmgen's denoise loop per step (from its timings; diffusers reports no split), peak GPU memory above the weights, and how
far the two images are apart; with --offload, a third row whose peak is the total on the GPU
(weights streamed from host memory) (random weights through 50 bf16 steps: a number, not a check; the
fp32 CPU parity tests are the check).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, and the tests' tiny tokenizer

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    environment_header,
    print_table,
    synchronize,
    write_json,
)
from qwen_image_cases import SCHEDULER, TINY_TRANSFORMER, hf_tokenizer, tiny_text_encoder, write_tokenizer  # noqa: E402
from qwen_image_step import build_models  # noqa: E402

from mmgen.loading.qwen_tokenizer import QwenTokenizer  # noqa: E402
from mmgen.models.qwen_image_text import QwenTextEncoder, language_model_of  # noqa: E402
from mmgen.render.metrics import psnr_uint8  # noqa: E402
from pipelines.qwen_image import QwenImagePipeline  # noqa: E402

PROMPT = "a cat sitting on a red chair in a sunny garden, photographed with a wide lens"
# Qwen2.5-VL-7B-Instruct's language model (Qwen-Image's text encoder); the vision tower at its defaults.
TEXT_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "rms_norm_eps": 1e-6,
    "vocab_size": 152064,
}


def text_encoder_7b(device: torch.device, dtype: torch.dtype):
    """Qwen2_5_VLForConditionalGeneration at the 7B config with random weights, built on the device."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(text_config=TEXT_7B)
    with torch.device(device):
        return transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, torch_dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1328)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny configs")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--offload",
        choices=("model", "layer"),
        default=None,
        help="then also mmgen with this offload (weights moved to pinned host memory; total peak shown)",
    )
    args = parser.parse_args()
    import diffusers

    device = bench_device(args.tiny)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    size = 64 if args.tiny else args.size
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        write_tokenizer(Path(tokenizer_dir))
        hf_tok, our_tok = hf_tokenizer(Path(tokenizer_dir)), QwenTokenizer.from_dir(tokenizer_dir)
    reference, ours = build_models(TINY_TRANSFORMER if args.tiny else {}, device, dtype)
    width = ours.config.joint_attention_dim
    if args.tiny:
        encoder = tiny_text_encoder(len(hf_tok), width).to(device, dtype)
        vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
        vae.register_to_config(latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    else:
        encoder = text_encoder_7b(device, dtype)
        vae = diffusers.AutoencoderKLQwenImage()
    vae = vae.to(device, dtype).eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    theirs = diffusers.QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=hf_tok, transformer=reference
    )
    theirs.set_progress_bar_config(disable=True)
    mine = QwenImagePipeline(
        ours, QwenTextEncoder(language_model_of(encoder)), our_tok, vae, scheduler, device=device
    )
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def diffusers_call(steps: int) -> np.ndarray:
        image = theirs(
            PROMPT,
            negative_prompt=" ",
            true_cfg_scale=args.guidance,
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images[0]
        return (image * 255).round().clip(0, 255).astype(np.uint8)

    def mmgen_call(steps: int):
        return mine(
            PROMPT,
            negative_prompt=" ",
            guidance_scale=args.guidance,
            height=size,
            width=size,
            num_inference_steps=steps,
            seed=0,
            progress=False,
        )

    def measure(call, above: int) -> tuple[object, float, float | None]:
        """(output, seconds, peak GiB above `above` bytes) of one timed call after a 2-step warm-up."""
        call(2)  # warm-up: kernels, allocator, autotuning
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        out = call(args.steps)
        synchronize(device)
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated(device) - above) / 2**30 if device.type == "cuda" else None
        return out, seconds, peak

    rows, images, results = [], {}, {}
    out, seconds, peak = measure(diffusers_call, weights)
    images["diffusers QwenImagePipeline"] = out
    results["diffusers QwenImagePipeline"] = {"s": seconds, "denoise_s": None, "peak_gib": peak}
    out, seconds, peak = measure(mmgen_call, weights)
    images["mmgen QwenImagePipeline"] = out.frames[0]
    results["mmgen QwenImagePipeline"] = {
        "s": seconds,
        "denoise_s": out.timings.get("denoise"),
        "peak_gib": peak,
    }
    if args.offload:
        # diffusers' pipeline shares the weight tensors: drop it so the placement's move frees the GPU.
        del theirs, reference, mine
        gc.collect()  # diffusers' pipeline objects hold reference cycles: free their GPU tensors now
        mine = QwenImagePipeline(
            ours,
            QwenTextEncoder(language_model_of(encoder)),
            our_tok,
            vae,
            scheduler,
            device=device,
            offload=args.offload,
        )
        out, seconds, peak = measure(mmgen_call, 0)  # the weights live on the host: the peak is the total
        label = f"mmgen, offload {args.offload}"
        results[label] = {"s": seconds, "denoise_s": out.timings.get("denoise"), "peak_gib": peak}
    base = results["diffusers QwenImagePipeline"]["s"]
    for label, r in results.items():
        loop = "-" if r["denoise_s"] is None else f"{r['denoise_s'] * 1e3 / args.steps:.1f}"
        rows.append([label, f"{r['s']:.2f}", loop, f"{base / r['s']:.2f}x", r["peak_gib"]])
    a, b = (images[k].astype(np.float64) for k in ("diffusers QwenImagePipeline", "mmgen QwenImagePipeline"))
    print(environment_header(device))
    print(f"Qwen-Image e2e: {size}x{size}, {args.steps} steps, true CFG {args.guidance}, {dtype}")
    print_table(
        [("pipeline", 30), ("s", 8), ("loop ms/step", 12), ("vs diffusers", 12), ("peak GiB", 9)], rows
    )
    print(f"images: max abs {np.abs(a - b).max():.0f} of 255, PSNR {psnr_uint8(a, b):.1f} dB")
    write_json(args.json, {"size": size, "steps": args.steps, "rows": results})


if __name__ == "__main__":
    main()
