"""Load Wan2.1 I2V's image encoder (transformers CLIPVisionModel format) and its image_processor config."""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_json, read_tensors
from mmgen.models.clip_vision import ClipImagePreprocess, ClipVisionConfig, ClipVisionEncoder

# transformers < 5 saved CLIPVisionModel under this prefix; 5.x saves without it.
OLD_PREFIX = "vision_model."
POSITION_IDS = "embeddings.position_ids"  # a buffer older checkpoints stored; recomputed, never read
ARCHITECTURES = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
PROJECTION_PREFIX = "visual_projection."  # CLIPVisionModelWithProjection's head: Wan never runs it


def read_clip_vision_config(directory: Path) -> ClipVisionConfig:
    path = Path(directory) / "config.json"
    raw = read_json(path)
    architectures = raw.get("architectures") or ["CLIPVisionModel"]
    if not set(architectures) & set(ARCHITECTURES):
        raise LoadError(f"{path}: architectures {architectures!r}; supported: {', '.join(ARCHITECTURES)}")
    try:
        return ClipVisionConfig.from_hf_config(raw)
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{path}: {err}") from err


def load_clip_vision(
    directory: Path | str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> ClipVisionEncoder:
    """The image encoder of `directory` (config.json + safetensors) in `dtype` on `device`, eval mode."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: image encoder directory not found")
    config = read_clip_vision_config(directory)
    tensors = read_tensors(find_weight_files(directory))

    def rename(key: str) -> str | None:
        key = key.removeprefix(OLD_PREFIX)
        return None if key == POSITION_IDS or key.startswith(PROJECTION_PREFIX) else key

    with torch.device("meta"):
        model = ClipVisionEncoder(config)
    load_into_module(model, tensors, source=directory, dtype=dtype, device=device, rename=rename)
    return model.eval().requires_grad_(False)


def load_image_preprocess(directory: Path | str) -> ClipImagePreprocess:
    """image_processor/preprocessor_config.json as a ClipImagePreprocess."""
    path = Path(directory) / "preprocessor_config.json"
    raw = read_json(path)
    try:
        return ClipImagePreprocess.from_config(raw)
    except (ValidationError, TypeError, ValueError, KeyError) as err:
        raise LoadError(f"{path}: {err}") from err
