"""Load a Wan2.1 VACE DiT from a transformer directory (config.json + safetensors): diffusers or original layout.

The diffusers layout is WanVACETransformer3DModel's config (the Wan fields plus vace_layers and
vace_in_channels) and weight names, loaded as they are. The original Wan2.1-VACE layout (config
model_type "vace" with vace_layers and vace_in_dim; weights as the original Wan DiT's plus
vace_patch_embedding and vace_blocks.N.*, whose before_proj / after_proj are diffusers' proj_in /
proj_out) is renamed to diffusers' names key by key (the facts: diffusers' single-file Wan converter).
As for the plain DiT, the model is built on the meta device and every weight allocated once in the
requested dtype (the norms, modulation tables and time MLP stay float32, as diffusers keeps them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import Reads, find_weight_files, load_into_module, read_json, read_tensors
from mmgen.loading.wan_transformer import load_wan_transformer, original_to_diffusers_key
from mmgen.models.wan import WanDiT
from mmgen.models.wan_vace import WanVACEConfig, WanVACEDiT
from mmgen.placement.tensors import PinnedStore

DIFFUSERS_VACE_CLASS = "WanVACETransformer3DModel"
ORIGINAL_VACE_CLASS = "VaceWanModel"
VACE_BLOCK_KEY = re.compile(r"vace_blocks\.(\d+)\.(.+)")
# original name inside vace_blocks.N. -> diffusers name; the rest of a VACE block is named as a Wan block
ORIGINAL_VACE_PROJECTIONS = (("before_proj.", "proj_in."), ("after_proj.", "proj_out."))
CONTROL_EMBEDDING = "vace_patch_embedding.weight"


def original_vace_to_diffusers_key(key: str) -> str:
    """The diffusers name of an original Wan2.1-VACE checkpoint key (an unknown key maps to a name no parameter has)."""
    if key.startswith("vace_patch_embedding."):
        return key
    match = VACE_BLOCK_KEY.fullmatch(key)
    if match is None:
        return original_to_diffusers_key(key)
    index, rest = match.groups()
    for old, new in ORIGINAL_VACE_PROJECTIONS:
        if rest.startswith(old):
            return f"vace_blocks.{index}.{new}{rest[len(old) :]}"
    return "vace_" + original_to_diffusers_key(f"blocks.{index}.{rest}")


def vace_layout(raw: Mapping, config_path: Path) -> str:
    """'diffusers' or 'original', from a VACE config.json's class name and fields."""
    class_name = raw.get("_class_name")
    if class_name in (DIFFUSERS_VACE_CLASS, None) and "vace_layers" in raw and "num_attention_heads" in raw:
        return "diffusers"
    if class_name in (ORIGINAL_VACE_CLASS, "WanModel", None) and raw.get("model_type") == "vace":
        return "original"
    raise LoadError(
        f"{config_path}: not a Wan VACE transformer config (_class_name={class_name!r}, "
        f"vace_layers {'present' if 'vace_layers' in raw else 'missing'}, model_type={raw.get('model_type')!r}); "
        f"expected {DIFFUSERS_VACE_CLASS} (diffusers) or model_type 'vace' (original Wan2.1-VACE)"
    )


def read_wan_vace_config(
    directory: Path | str, *, vace_in_dim: int | None = None
) -> tuple[WanVACEConfig, str]:
    """The WanVACEConfig and layout ('diffusers' / 'original') of a VACE transformer directory's config.json.

    vace_in_dim: the control width for an original config that lacks it (from the weights).
    """
    config_path = Path(directory) / "config.json"
    raw = read_json(config_path)
    layout = vace_layout(raw, config_path)
    try:
        if layout == "diffusers":
            return WanVACEConfig.from_diffusers_config(raw), layout
        return WanVACEConfig.from_original_config(raw, vace_in_dim=vace_in_dim), layout
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{config_path}: {err}") from err


def load_wan_vace_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    read: Reads = True,
) -> WanVACEDiT:
    """Load the Wan VACE DiT of a transformer directory (either layout) in `dtype` on `device` (read
    False: allocated, not read; see load_into_module)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Wan VACE transformer directory not found")
    tensors = read_tensors(find_weight_files(directory))
    control = tensors.get(CONTROL_EMBEDDING)
    config, layout = read_wan_vace_config(
        directory, vace_in_dim=None if control is None else control[0].shape[1]
    )
    with torch.device("meta"):
        model = WanVACEDiT(config)
    load_into_module(
        model,
        tensors,
        source=directory,
        dtype=dtype,
        device=device,
        rename=original_vace_to_diffusers_key if layout == "original" else (lambda key: key),
        keep_fp32=WanVACEDiT.keeps_fp32,
        read=read,
    )
    return model.eval().requires_grad_(False)


def load_wan_dit(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    host: PinnedStore | None = None,
    read: Reads = True,
) -> WanDiT:
    """The DiT of a transformer directory (either layout): a WanVACEDiT when its config.json has
    vace_layers (Wan2.1 VACE), else a WanDiT (host, read: see load_wan_transformer; host refused for VACE)."""
    directory = Path(directory)
    if "vace_layers" not in read_json(directory / "config.json"):
        return load_wan_transformer(directory, dtype=dtype, device=device, host=host, read=read)
    if host is not None:
        raise LoadError(
            f"{directory}: Wan VACE: offload (weights loaded into host memory) is not supported yet"
        )
    return load_wan_vace_transformer(directory, dtype=dtype, device=device, read=read)
