"""Load a Wan2.1 VACE DiT from a diffusers-format transformer directory (config.json + safetensors).

The config is diffusers' WanVACETransformer3DModel's (the Wan fields plus vace_layers and
vace_in_channels); the weights load under their own names. As for the plain DiT, the model is built
on the meta device and every weight allocated once in the requested dtype (the norms, modulation
tables and time MLP stay float32, as diffusers keeps them). The original Wan2.1-VACE layout is not
read yet: its config class raises.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_json, read_tensors
from mmgen.models.wan_vace import WanVACEConfig, WanVACEDiT

DIFFUSERS_VACE_CLASS = "WanVACETransformer3DModel"


def read_wan_vace_config(directory: Path | str) -> WanVACEConfig:
    """The WanVACEConfig of a diffusers-format VACE transformer directory's config.json."""
    config_path = Path(directory) / "config.json"
    raw = read_json(config_path)
    class_name = raw.get("_class_name")
    if class_name not in (DIFFUSERS_VACE_CLASS, None) or "vace_layers" not in raw:
        raise LoadError(
            f"{config_path}: not a diffusers Wan VACE transformer config (_class_name={class_name!r}, "
            f"vace_layers {'present' if 'vace_layers' in raw else 'missing'}); expected {DIFFUSERS_VACE_CLASS}"
        )
    try:
        return WanVACEConfig.from_diffusers_config(raw)
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{config_path}: {err}") from err


def load_wan_vace_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> WanVACEDiT:
    """Load the Wan VACE DiT of a diffusers-format transformer directory in `dtype` on `device`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Wan VACE transformer directory not found")
    config = read_wan_vace_config(directory)
    tensors = read_tensors(find_weight_files(directory))
    with torch.device("meta"):
        model = WanVACEDiT(config)
    load_into_module(
        model, tensors, source=directory, dtype=dtype, device=device, keep_fp32=WanVACEDiT.keeps_fp32
    )
    return model.eval().requires_grad_(False)
