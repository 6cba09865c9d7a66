"""Load the Qwen-Image-2.1 transformer from a diffusers-format directory (config.json + safetensors shards).

The tensor names are those of QwenImage21Transformer's parameters (diffusers' QwenImage21Transformer2DModel
names), so every key loads as it is; a key left over or missing is a LoadError naming the file and tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.loading.safetensors_dir import Reads
from mmgen.loading.transformer_dir import load_transformer_dir, read_transformer_config
from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
from mmgen.placement.tensors import PinnedStore

DIFFUSERS_CLASS = "QwenImage21Transformer2DModel"
TITLE = "Qwen-Image-2.1"


def read_qwen_image21_config(directory: Path | str) -> QwenImage21Config:
    """The QwenImage21Config of a transformer directory's config.json (a LoadError names the file)."""
    return read_transformer_config(directory, DIFFUSERS_CLASS, QwenImage21Config.from_diffusers, TITLE)


def qwen_image21_heads(directory: Path) -> int:
    """The attention heads of a Qwen-Image-2.1 model directory's transformer, from transformer/config.json
    alone (no weights; a LoadError names a missing or broken file)."""
    return read_qwen_image21_config(Path(directory) / "transformer").num_attention_heads


def load_qwen_image21_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    host: PinnedStore | None = None,
    read: Reads = True,
) -> QwenImage21Transformer:
    """The transformer of a diffusers-format directory, in `dtype` on `device`, eval, without gradients
    (read False: allocated, not read; mmgen.loading.safetensors_dir.load_into_module)."""
    config = read_qwen_image21_config(directory)
    build = lambda: QwenImage21Transformer(config)  # noqa: E731
    return load_transformer_dir(directory, build, dtype=dtype, device=device, host=host, read=read)
