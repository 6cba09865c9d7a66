"""Output identity of a fixed list of requests, to prove a refactor left every output bit-identical.

Run it on the code before a refactor and again after, on the same machine, and compare the two
files: every case must keep both SHAs. The SHAs are not portable across CPUs (or BLAS builds, or
thread counts): a GEMM may round differently elsewhere, so compare only runs made here.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 tests/identity_list.py --out before.json
    ... refactor ...
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 tests/identity_list.py --out after.json
    diff before.json after.json

Writes JSON {case name: {"frames_sha256": ..., "latents_sha256": ...}}. Only the faces meant to
survive a refactor are used: `WanT2VPipeline.from_pretrained(dir, dtype=..., device=...)`,
`pipe(prompt, seed=..., keyword=...)` and the `mmgen render` command (whose CFG-parallel case reads
its SHAs from manifest.jsonl); for Qwen-Image `QwenImagePipeline` / `QwenImageEditPipeline.from_pretrained`
and `pipe(prompt, ...)` on the tiny random directories of tests/qwen_image_cases.py and
tests/qwen_image_edit_cases.py (seeded weights: the same directory on every run). The SHAs of the in-process cases are computed here from the frames
and latents (shape + bytes), independently of the pipeline's own identity code. Cases run on the
embedded default model (CPU, float32, 48x48, 9 frames, 4 steps); the I2V case on a copy of it
whose DiT takes the I2V input (noise + image latents + first-frame mask, the extra input channels
seeded random); the LoRA cases on a wan-format LoRA from tests/lora_cases.py. Not a pytest module.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# One thread unless the caller chose (before torch is imported): a fixed reduction order on this machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # lora_cases

PROMPT = "a red circle moves left on a black background"
NEGATIVE = "blurry"
SEED = 7
STEPS = 4
SIZE = dict(height=48, width=48, num_frames=9)


def frames_sha256(frames: np.ndarray) -> str:
    frames = np.ascontiguousarray(frames)
    return hashlib.sha256(repr(frames.shape).encode() + frames.tobytes()).hexdigest()


def latents_sha256(latents: torch.Tensor) -> str:
    array = latents.detach().to("cpu", torch.float32).contiguous().numpy()
    return hashlib.sha256(repr(array.shape).encode() + array.tobytes()).hexdigest()


def identity(result) -> dict[str, str]:
    return {"frames_sha256": frames_sha256(result.frames), "latents_sha256": latents_sha256(result.latents)}


def i2v_model(default_dir: Path, folder: Path) -> Path:
    """A copy of the default model whose DiT takes I2V input: the default weights for the noise
    channels, seeded random (scale 0.02) ones for the image-latent and mask channels."""
    from safetensors.torch import load_file, save_file

    from mmgen.default_model import VAE, Z_DIM

    target = folder / "i2v-model"
    shutil.copytree(default_dir, target)
    config_path = target / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    extra = Z_DIM + VAE["scale_factor_temporal"]
    config["in_channels"] = Z_DIM + extra
    config_path.write_text(json.dumps(config, indent=2))
    weights_path = target / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(weights_path)
    weight = weights["patch_embedding.weight"]  # [dim, in_channels, *patch]
    shape = (weight.shape[0], extra, *weight.shape[2:])
    added = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.02
    weights["patch_embedding.weight"] = torch.cat([weight, added.to(weight.dtype)], dim=1).contiguous()
    save_file(weights, weights_path)
    return target


def input_image(folder: Path) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:48, 0:48]
    base = np.stack([x * 5.0, y * 5.0, (x + y) * 2.5], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    path = folder / "input.png"
    Image.fromarray(pixels).save(path)
    return path


def lora_file(pipe, folder: Path) -> Path:
    from lora_cases import save, wan_lora

    return save(folder / "lora.safetensors", *wan_lora(pipe.transformer, seed=0))


def pipeline_cases(default_dir: Path, folder: Path) -> dict[str, dict[str, str]]:
    from pipelines.wan_t2i import WanT2IPipeline
    from pipelines.wan_t2v import WanT2VPipeline

    load = dict(dtype=torch.float32, device="cpu")
    pipe = WanT2VPipeline.from_pretrained(default_dir, **load)
    lora = lora_file(pipe, folder)
    base = dict(seed=SEED, num_inference_steps=STEPS, progress=False, **SIZE)
    cases = {
        "t2v_default_call": dict(seed=SEED, progress=False),
        "t2v": {},
        "t2v_negative_prompt": dict(negative_prompt=NEGATIVE),
        "lora_fused": dict(lora=f"{lora}:0.8"),
        "lora_unfused": dict(lora=f"{lora}:0.8", lora_mode="unfused"),
        "step_cache": dict(step_cache=2.5),  # reuses a middle step of the 4
        "cfg_truncation": dict(cfg_truncation=0.5),
        "offload_layer": dict(offload="layer"),
        "cfg_sequential": dict(cfg="sequential"),
        "block_chunk_64": dict(block_chunk=64),
        "ffn_chunk_64": dict(ffn_chunk=64),
        "fp8_linear": dict(fp8_linear=True),
        "fp8_linear_attention": dict(fp8_linear=True, fp8_attention=True),
    }
    out = {}
    for name, kwargs in cases.items():
        request = kwargs if name == "t2v_default_call" else {**base, **kwargs}
        result = pipe(PROMPT, **request)
        out[name] = identity(result)
        print(name, out[name]["frames_sha256"][:16], result.args.get("step_cache_reused", ""), flush=True)
    t2i = WanT2IPipeline.from_pretrained(default_dir, **load)
    out["t2i"] = identity(t2i(PROMPT, seed=SEED, num_inference_steps=STEPS, progress=False))
    out["t2v_one_frame"] = identity(pipe(PROMPT, **{**base, "num_frames": 1}))
    i2v = WanT2VPipeline.from_pretrained(i2v_model(default_dir, folder), **load)
    out["i2v"] = identity(i2v(PROMPT, image=input_image(folder), **base))
    for name in ("t2i", "t2v_one_frame", "i2v"):
        print(name, out[name]["frames_sha256"][:16], flush=True)
    return out


QWEN_SIZE = dict(height=48, width=80)  # a non-square image: rows and columns are not interchangeable


def qwen_image_cases(folder: Path) -> dict[str, dict[str, str]]:
    """Qwen-Image T2I and Qwen-Image-Edit on tiny random directories (CPU, float32, 3 steps)."""
    from qwen_image_cases import write_comfy_lora, write_qwen_image_dir
    from qwen_image_edit_cases import write_qwen_image_edit_dir

    from pipelines.qwen_image import QwenImagePipeline
    from pipelines.qwen_image_edit import QwenImageEditPipeline

    load = dict(dtype=torch.float32, device="cpu")
    t2i_dir = write_qwen_image_dir(folder / "qwen")
    pipe = QwenImagePipeline.from_pretrained(t2i_dir, **load)
    lora = write_comfy_lora(pipe.transformer, folder / "qwen-lora.safetensors")
    base = dict(seed=SEED, num_inference_steps=3, progress=False, **QWEN_SIZE)
    cases = {
        "qwen_t2i": dict(negative_prompt=NEGATIVE),
        "qwen_t2i_unguided": {},
        "qwen_t2i_cfg_sequential": dict(negative_prompt=NEGATIVE, cfg="sequential"),
        "qwen_t2i_lora_fused": dict(negative_prompt=NEGATIVE, lora=f"{lora}:0.8"),
        "qwen_t2i_lora_unfused": dict(negative_prompt=NEGATIVE, lora=f"{lora}:0.8", lora_mode="unfused"),
        "qwen_t2i_preset": dict(preset="lightning-4step", num_inference_steps=None),
    }
    out = {}
    for name, kwargs in cases.items():
        request = {key: value for key, value in {**base, **kwargs}.items() if value is not None}
        out[name] = identity(pipe(PROMPT, **request))
    layer = QwenImagePipeline.from_pretrained(t2i_dir, offload="layer", **load)
    out["qwen_t2i_offload_layer"] = identity(layer(PROMPT, negative_prompt=NEGATIVE, **base))
    del pipe, layer
    edit = QwenImageEditPipeline.from_pretrained(write_qwen_image_edit_dir(folder / "qwen-edit"), **load)
    image = input_image(folder)
    out["qwen_edit"] = identity(edit("make it blue", negative_prompt=NEGATIVE, image=image, **base))
    plain = dict(seed=SEED, num_inference_steps=2, progress=False)  # the output size: the image's own
    out["qwen_edit_unguided_default_size"] = identity(edit("make it blue", image=image, **plain))
    for name in sorted(out):
        print(name, out[name]["frames_sha256"][:16], flush=True)
    return out


RENDER = """\
model: default
device: cpu
dtype: float32
defaults: {{height: 48, width: 48, num_frames: 9, num_inference_steps: {steps}, cfg: sequential}}
jobs:
  - {{name: cat, prompt: "{prompt}", seed: {seed}}}
"""


def render(cache_dir: Path, folder: Path, *flags: str) -> dict[str, str]:
    """`mmgen render FILE *flags` (`--gpus 2 --cfg-parallel`: 2 gloo processes): the SHAs from manifest.jsonl."""
    config = folder / "render.yaml"
    config.write_text(RENDER.format(steps=STEPS, prompt=PROMPT, seed=SEED))
    out = Path(tempfile.mkdtemp(prefix="render-out-", dir=folder))
    command = [sys.executable, "-m", "mmgen.cli", "render", str(config), "--out", str(out), "--no-progress"]
    env = {**os.environ, "MMGEN_CACHE_DIR": str(cache_dir)}
    subprocess.run([*command, *flags], env=env, check=True)
    (record,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert record["status"] == "ok", record
    return {"frames_sha256": record["frames_sha256"], "latents_sha256": record["latents_sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    from mmgen.default_model import ensure_default_model

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with tempfile.TemporaryDirectory(prefix="mmgen-identity-") as tmp:
        folder = Path(tmp)
        cache_dir = folder / "cache"
        default_dir = ensure_default_model(cache_dir)
        results = pipeline_cases(default_dir, folder)
        results.update(qwen_image_cases(folder))
        results["render_1proc"] = render(cache_dir, folder)
        results["render_cfg_parallel_2proc"] = render(cache_dir, folder, "--gpus", "2", "--cfg-parallel")
    args.out.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
    print(f"{len(results)} cases -> {args.out}")


if __name__ == "__main__":
    main()
