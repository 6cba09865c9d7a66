"""Load a Wan DiT (any Wan2.1 / Wan2.2 variant) from a local directory: diffusers or original key layout.

A directory holds config.json and safetensors weights (one file, or shards with an index). The
layout is read from config.json: diffusers' WanTransformer3DModel fields (num_attention_heads, ...)
or the original WanModel fields (dim, num_heads, in_dim, ...). Original keys are renamed explicitly
to diffusers' names (the facts behind the map: diffusers' convert_wan_to_diffusers script). The model
is built on the meta device and every weight is allocated once, in the requested dtype and device
(the norms, modulation tables and time MLP stay float32, as diffusers keeps them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import Reads, find_weight_files, load_into_module, read_json, read_tensors
from mmgen.models.wan import WanConfig, WanDiT
from mmgen.placement.tensors import PinnedStore

DIFFUSERS_CLASS = "WanTransformer3DModel"
ORIGINAL_CLASS = "WanModel"
# original key prefix -> diffusers key prefix, outside the blocks
ORIGINAL_TOP_LEVEL = (
    ("patch_embedding.", "patch_embedding."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    # Wan2.1 I2V / FLF2V image path
    ("img_emb.proj.0.", "condition_embedder.image_embedder.norm1."),
    ("img_emb.proj.1.", "condition_embedder.image_embedder.ff.net.0.proj."),
    ("img_emb.proj.3.", "condition_embedder.image_embedder.ff.net.2."),
    ("img_emb.proj.4.", "condition_embedder.image_embedder.norm2."),
)
IMAGE_EMBEDDING_PREFIX = "img_emb."
# original key prefix inside blocks.N. -> diffusers prefix; the original's norm3 is the affine
# cross-attention norm that diffusers calls norm2 (the original's norm2 holds no weights).
ORIGINAL_BLOCK = (
    *((f"self_attn.{a}.", f"attn1.{b}.") for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"))),
    ("self_attn.o.", "attn1.to_out.0."),
    ("self_attn.norm_q.", "attn1.norm_q."),
    ("self_attn.norm_k.", "attn1.norm_k."),
    *((f"cross_attn.{a}.", f"attn2.{b}.") for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"))),
    ("cross_attn.o.", "attn2.to_out.0."),
    ("cross_attn.norm_q.", "attn2.norm_q."),
    ("cross_attn.norm_k.", "attn2.norm_k."),
    ("cross_attn.k_img.", "attn2.add_k_proj."),
    ("cross_attn.v_img.", "attn2.add_v_proj."),
    ("cross_attn.norm_k_img.", "attn2.norm_added_k."),
    ("norm3.", "norm2."),
    ("ffn.0.", "ffn.net.0.proj."),
    ("ffn.2.", "ffn.net.2."),
)
BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
# A rename result no parameter has: load_into_module then reports the original key as unknown.
UNMAPPED = "<no diffusers name>."


def original_to_diffusers_key(key: str) -> str:
    """The diffusers name of an original Wan checkpoint key (an unknown key maps to a name no parameter has)."""
    if key == "head.modulation":
        return "scale_shift_table"
    if key == "img_emb.emb_pos":
        return "condition_embedder.image_embedder.pos_embed"
    for old, new in ORIGINAL_TOP_LEVEL:
        if key.startswith(old):
            return new + key[len(old) :]
    match = BLOCK_KEY.fullmatch(key)
    if match:
        index, rest = match.groups()
        if rest == "modulation":
            return f"blocks.{index}.scale_shift_table"
        for old, new in ORIGINAL_BLOCK:
            if rest.startswith(old):
                return f"blocks.{index}.{new}{rest[len(old) :]}"
    return UNMAPPED + key


def checkpoint_layout(raw: Mapping, config_path: Path) -> str:
    """'diffusers' or 'original', from a config.json's class name and fields."""
    class_name = raw.get("_class_name")
    if class_name == DIFFUSERS_CLASS or (class_name is None and "num_attention_heads" in raw):
        return "diffusers"
    if class_name == ORIGINAL_CLASS or (class_name is None and "num_heads" in raw):
        return "original"
    raise LoadError(
        f"{config_path}: not a Wan text-to-video transformer config (_class_name={class_name!r}); "
        f"expected {DIFFUSERS_CLASS} (diffusers) or {ORIGINAL_CLASS} (original Wan)"
    )


# Where a Wan directory's (first) transformer config sits: diffusers format, the original Wan2.2
# A14B layout, the original Wan2.1 (its DiT's config at the root); and its head-count field:
# diffusers' name, then the original config's.
TRANSFORMER_FOLDERS = ("transformer", "high_noise_model", ".")
HEADS_FIELDS = ("num_attention_heads", "num_heads")


def wan_heads(directory: Path) -> int | None:
    """The attention heads of a Wan directory's transformer, from its config.json alone (no weights,
    any layout); None when no readable config holds them (the loader then reports what is wrong)."""
    for folder in TRANSFORMER_FOLDERS:
        try:
            config = json.loads((Path(directory) / folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        for field in HEADS_FIELDS:
            heads = config.get(field) if isinstance(config, dict) else None
            if isinstance(heads, int) and not isinstance(heads, bool):
                return heads
    return None


def read_wan_config(directory: Path, *, has_image_embedding: bool = False) -> tuple[WanConfig, str]:
    """The WanConfig and layout ('diffusers' / 'original') of a transformer directory's config.json.

    has_image_embedding: whether the weights hold the original layout's img_emb.* tensors (Wan2.1
    I2V and Wan2.2 I2V share model_type 'i2v'; only the weights tell them apart).
    """
    config_path = Path(directory) / "config.json"
    raw = read_json(config_path)
    layout = checkpoint_layout(raw, config_path)
    try:
        if layout == "diffusers":
            return WanConfig.from_diffusers_config(raw), layout
        return WanConfig.from_original_config(raw, has_image_embedding=has_image_embedding), layout
    except (ValidationError, TypeError, ValueError) as err:
        raise LoadError(f"{config_path}: {err}") from err


def wan_dit_from_tensors(
    config: WanConfig,
    tensors: Mapping[str, tuple[torch.Tensor, Path]],
    *,
    source: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    layout: str = "diffusers",
    host: PinnedStore | None = None,
    read: Reads = True,
) -> WanDiT:
    """A WanDiT from checkpoint tensors {key: (tensor, file)}; keys in the given layout (host, read:
    load_into_module)."""
    with torch.device("meta"):
        model = WanDiT(config)
    rename = original_to_diffusers_key if layout == "original" else (lambda key: key)
    load_into_module(
        model,
        tensors,
        source=source,
        dtype=dtype,
        device=device,
        rename=rename,
        keep_fp32=WanDiT.keeps_fp32,
        host=host,
        read=read,
    )
    return model.eval().requires_grad_(False)


def load_wan_transformer(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    host: PinnedStore | None = None,
    read: Reads = True,
) -> WanDiT:
    """Load the Wan DiT of a transformer directory (config.json + safetensors) in `dtype` on `device`
    (host: a PinnedStore to read the weights into; read False: allocated, not read; see load_into_module)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Wan transformer directory not found")
    config, layout = read_wan_config(directory)
    tensors = read_tensors(find_weight_files(directory))
    if layout == "original" and any(key.startswith(IMAGE_EMBEDDING_PREFIX) for key in tensors):
        config, layout = read_wan_config(directory, has_image_embedding=True)
    return wan_dit_from_tensors(
        config, tensors, source=directory, dtype=dtype, device=device, layout=layout, host=host, read=read
    )
