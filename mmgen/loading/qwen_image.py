"""Load the Qwen-Image transformer from a diffusers-format directory (config.json + safetensors shards).

Qwen's release (Qwen/Qwen-Image, transformer/) is in this layout: the tensor names are those of
QwenImageTransformer's parameters, so every key loads as it is, and any key left over or missing is
a LoadError naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.loading.transformer_dir import load_transformer_dir, read_transformer_config
from mmgen.models.qwen_image import QwenImageConfig, QwenImageTransformer
from mmgen.placement.tensors import PinnedStore

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"


def read_qwen_image_config(directory: Path | str) -> QwenImageConfig:
    """The QwenImageConfig of a transformer directory's config.json (a LoadError names the file)."""
    return read_transformer_config(directory, DIFFUSERS_CLASS, QwenImageConfig.from_diffusers, "Qwen-Image")


def load_qwen_image_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    host: PinnedStore | None = None,
) -> QwenImageTransformer:
    """The transformer of a diffusers-format directory, in `dtype` on `device`, eval, without gradients
    (host: a PinnedStore to read the weights into, see load_into_module)."""
    config = read_qwen_image_config(directory)
    build = lambda: QwenImageTransformer(config)  # noqa: E731
    return load_transformer_dir(directory, build, dtype=dtype, device=device, host=host)
