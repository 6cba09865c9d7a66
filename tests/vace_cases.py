"""A tiny Wan2.1 VACE model directory the VACE tests share, and the inputs they draw.

`write_vace_dir` copies the embedded default model (text encoder, tokenizer, VAE, scheduler) and
replaces its transformer with a tiny random diffusers WanVACETransformer3DModel (every weight moved
off its initial value), its model_index.json naming WanVACEPipeline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from mmgen.default_model import TEXT_DIM, VAE, Z_DIM

VACE = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=64,
    num_layers=3,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    vace_layers=[0, 2],
    vace_in_channels=2 * Z_DIM
    + VAE["scale_factor_spatial"] ** 2,  # inactive + reactive latents, the packed mask
)


def vace_transformer(seed: int = 3, **changes: object):
    """A tiny diffusers WanVACETransformer3DModel (VACE with `changes`), every weight jittered by
    N(0, 0.05) from `seed`."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    transformer = WanVACETransformer3DModel(**{**VACE, **changes}).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in transformer.parameters():  # every weight off its default (zero-initialised proj_out too)
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return transformer


def write_vace_dir(default_model_dir: Path, directory: Path) -> Path:
    """A diffusers-layout Wan2.1 VACE directory at `directory` (see the module docstring)."""
    shutil.copytree(default_model_dir, directory, ignore=shutil.ignore_patterns("transformer"))
    vace_transformer().save_pretrained(directory / "transformer")
    index = json.loads((directory / "model_index.json").read_text())
    index.update(_class_name="WanVACEPipeline", transformer=["diffusers", "WanVACETransformer3DModel"])
    (directory / "model_index.json").write_text(json.dumps(index))
    return directory


def picture(height: int, width: int, seed: int) -> np.ndarray:
    """A uint8 [height, width, 3] gradient with seeded noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
