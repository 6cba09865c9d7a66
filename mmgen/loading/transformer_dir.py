"""A diffusers-format transformer directory (config.json + safetensors shards) into an mmgen model.

Shared by the families whose tensor names are their mmgen model's parameter names (Qwen-Image,
Qwen-Image-2.1): every key loads as it is; a key left over or missing is a LoadError naming the file
and the tensor, a config this code cannot build is a LoadError naming config.json.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import Reads, find_weight_files, load_into_module, read_json, read_tensors
from mmgen.placement.tensors import PinnedStore

Config = TypeVar("Config")
Model = TypeVar("Model", bound=nn.Module)


def read_transformer_config(
    directory: Path | str, class_name: str, parse: Callable[[Mapping[str, Any]], Config], title: str
) -> Config:
    """parse(config.json) of a transformer directory whose _class_name is `class_name` (or absent)."""
    if not Path(directory).is_dir():
        raise LoadError(f"{directory}: {title} transformer directory not found")
    config_path = Path(directory) / "config.json"
    raw = read_json(config_path)
    found = raw.get("_class_name")
    if found not in (class_name, None):
        raise LoadError(
            f"{config_path}: not a {title} transformer config (_class_name={found!r}); expected {class_name}"
        )
    try:
        return parse(raw)
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{config_path}: {err}") from err


def load_transformer_dir(
    directory: Path | str,
    build: Callable[[], Model],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    host: PinnedStore | None = None,
    read: Reads = True,
) -> Model:
    """build() on the meta device, its weights read from the directory's shards, in `dtype` on `device`,
    eval, without gradients (host: a PinnedStore to read the weights into; read False: allocated, not
    read; see load_into_module)."""
    directory = Path(directory)
    tensors = read_tensors(find_weight_files(directory))
    with torch.device("meta"):
        model = build()
    load_into_module(model, tensors, source=directory, dtype=dtype, device=device, host=host, read=read)
    return model.eval().requires_grad_(False)
