"""Module names of the original Wan repo (ComfyUI, kohya, lightx2v files) -> mmgen/diffusers names.

The facts are those of diffusers' own Wan checkpoint and LoRA conversions: q/k/v/o -> to_q/to_k/
to_v/to_out.0; the cross-attention norm is `norm3` in the original and `norm2` in diffusers (and
the other way round for the affine-less FFN norm); k_img/v_img (I2V) -> add_k_proj/add_v_proj.
"""

from __future__ import annotations

import re

_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k"}
_IMAGE_ATTN = {"k_img": "add_k_proj", "v_img": "add_v_proj", "norm_k_img": "norm_added_k"}
_BLOCK = {
    "norm1": "norm1",
    "norm3": "norm2",
    "norm2": "norm3",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
# Parameters that are not a module's `.weight` (modulation tables): the name is the parameter itself.
_PARAMETERS = {"head.modulation": "scale_shift_table"}
_BLOCK_PATTERN = re.compile(r"blocks\.(\d+)\.(.+)")
# kohya / musubi-tuner flatten the dots of a module name into underscores after "lora_unet_".
_MUSUBI_PATTERN = re.compile(
    r"blocks_(\d+)_(?:(self_attn|cross_attn)_(q|k|v|o|k_img|v_img|norm_q|norm_k|norm_k_img)|(ffn|norm)_?(\d))"
)
# Linears whose input's producer can leave spare columns after it for the "concat" LoRA kernel
# (mmgen.layers.low_rank): the WanBlock norm kernels (norm2 -> cross q, norm3 -> FFN up, and norm1 ->
# self q/k/v, but only stacked (WanDiT.fuse_projections): unstacked, k and v read the same input as
# q) and the attention (-> the o-projections, where the impl writes into a given buffer).
_PADDED_ALONE = re.compile(r"blocks\.\d+\.(attn2\.to_q|ffn\.net\.0\.proj|attn[12]\.to_out\.0)")
_SELF_QKV = re.compile(r"(blocks\.\d+\.attn1)\.to_[qkv]")
_MUSUBI_TOP = re.compile(r"(text_embedding|time_embedding|time_projection|img_emb_proj)_(\d)")


def original_parameter(module: str) -> tuple[str, str | None] | None:
    """An original-format module name -> (weight parameter, bias parameter or None), or None if unknown.

    "blocks.3.self_attn.q" -> ("blocks.3.attn1.to_q.weight", "blocks.3.attn1.to_q.bias");
    "blocks.3.modulation" -> ("blocks.3.scale_shift_table", None).
    """
    if module in _PARAMETERS:
        return _PARAMETERS[module], None
    if module in _TOP:
        return _linear(_TOP[module])
    match = _BLOCK_PATTERN.fullmatch(module)
    if match is None:
        return None
    index, rest = match.groups()
    prefix = f"blocks.{index}"
    if rest == "modulation":
        return f"{prefix}.scale_shift_table", None
    if rest in _BLOCK:
        return _linear(f"{prefix}.{_BLOCK[rest]}")
    attention, _, part = rest.partition(".")
    layer = {"self_attn": "attn1", "cross_attn": "attn2"}.get(attention)
    name = _ATTN.get(part) or (_IMAGE_ATTN.get(part) if attention == "cross_attn" else None)
    if layer is None or name is None:
        return None
    return _linear(f"{prefix}.{layer}.{name}")


def musubi_module(flat: str) -> str | None:
    """A kohya/musubi flattened name (after "lora_unet_") -> the original dotted name, or None.

    "blocks_3_self_attn_q" -> "blocks.3.self_attn.q"; "blocks_3_ffn_0" -> "blocks.3.ffn.0".
    """
    match = _MUSUBI_PATTERN.fullmatch(flat)
    if match is not None:
        index, attention, part, other, digit = match.groups()
        if attention is not None:
            return f"blocks.{index}.{attention}.{part}"
        return f"blocks.{index}.{other}.{digit}" if other == "ffn" else f"blocks.{index}.norm{digit}"
    top = _MUSUBI_TOP.fullmatch(flat)
    if top is not None:
        return f"{top.group(1).replace('_proj', '.proj')}.{top.group(2)}"
    if flat in ("head_head", "patch_embedding"):
        return flat.replace("head_head", "head.head")
    return None


def is_image_target(weight: str) -> bool:
    """Whether a weight belongs to the image-conditioning layers only I2V models have."""
    return (
        ".attn2.add_k_proj." in weight  # Wan's cross-attention; Qwen-Image's attn.add_k_proj is not
        or ".attn2.add_v_proj." in weight
        or ".attn2.norm_added_k." in weight
        or (weight.startswith("condition_embedder.image_embedder."))
    )


def _linear(module: str) -> tuple[str, str]:
    return f"{module}.weight", f"{module}.bias"


def takes_padded_input(group: tuple[str, ...]) -> bool:
    """Whether a group of WanDiT Linears (mmgen names; one layer, or the layers of one stacked matrix)
    reads an input its producer can write with room for the "concat" LoRA kernel's spare columns: a
    norm kernel's output (self q/k/v stacked, cross q, FFN up) or the attention output (the
    o-projections; WanAttention.output_spare_columns says when it is padded at run time).

    ("blocks.3.ffn.net.0.proj",), ("blocks.3.attn1.to_out.0",) and ("blocks.3.attn1.to_q",
    "blocks.3.attn1.to_k", "blocks.3.attn1.to_v") do; ("blocks.3.attn1.to_q",) alone, FFN down
    (its input is the GELU epilogue's output) and cross-attention k/v (the text) do not.
    """
    if len(group) == 1:
        return _PADDED_ALONE.fullmatch(group[0]) is not None
    matches = [_SELF_QKV.fullmatch(name) for name in group]
    return (
        len(group) == 3
        and all(matches)
        and len({match.group(1) for match in matches}) == 1
        and sorted(name[-4:] for name in group) == ["to_k", "to_q", "to_v"]
    )
