"""Load the Qwen-Image-2.1 transformer from a diffusers-format directory (config.json + safetensors shards).

The tensor names are those of QwenImage21Transformer's parameters (diffusers' QwenImage21Transformer2DModel
names), so every key loads as it is; a key left over or missing is a LoadError naming the file and tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_json, read_tensors
from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
from mmgen.placement.tensors import PinnedStore

DIFFUSERS_CLASS = "QwenImage21Transformer2DModel"


def read_qwen_image21_config(directory: Path | str) -> QwenImage21Config:
    """The QwenImage21Config of a transformer directory's config.json (a LoadError names the file)."""
    config_path = Path(directory) / "config.json"
    raw = read_json(config_path)
    class_name = raw.get("_class_name")
    if class_name not in (DIFFUSERS_CLASS, None):
        raise LoadError(
            f"{config_path}: not a Qwen-Image-2.1 transformer config (_class_name={class_name!r}); "
            f"expected {DIFFUSERS_CLASS}"
        )
    try:
        return QwenImage21Config.from_diffusers(raw)
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{config_path}: {err}") from err


def load_qwen_image21_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    host: PinnedStore | None = None,
) -> QwenImage21Transformer:
    """The transformer of a diffusers-format directory, in `dtype` on `device`, eval, without gradients."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Qwen-Image-2.1 transformer directory not found")
    config = read_qwen_image21_config(directory)
    tensors = read_tensors(find_weight_files(directory))
    with torch.device("meta"):
        model = QwenImage21Transformer(config)
    load_into_module(model, tensors, source=directory, dtype=dtype, device=device, host=host)
    return model.eval().requires_grad_(False)
