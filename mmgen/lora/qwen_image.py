"""Qwen-Image LoRA files -> LoRAContents: the layouts diffusers' QwenImageLoraLoaderMixin reads.

Qwen-Image's own module names are diffusers' (transformer_blocks.N.attn.to_q, img_mlp.net.0.proj,
...), so every layout names the same modules, with a different prefix or flattening:
- diffusers / PEFT: `transformer.<module>.lora_A.weight` / `.lora_B.weight` (+ PEFT metadata), read
  by mmgen.lora.readers.parse_diffusers (alpha from the metadata);
- ComfyUI / lightx2v (the Lightning distillation LoRAs) / musubi-tuner: `diffusion_model.<module>.`
  or bare `<module>.` with `lora_down.weight` / `lora_up.weight` (or lora_A / lora_B) and an
  optional scalar `.alpha`: scale alpha / rank, else 1 (diffusers' conversion);
- kohya: `lora_unet_<module with underscores>.lora_down.weight` ..., the flat name mapped back
  through FLAT_LEAVES (block layers) and FLAT_TOP (the rest);
- PEFT's adapter name `.default.` inside a key is dropped (as diffusers does).
Keys no rule reads are `unknown`: the application refuses them unless unmatched keys are allowed,
and a module the transformer does not have is refused there too (fail closed).

Qwen-Image-2.1 reads its files here too (pipelines.qwen_image21_family.read_qwen_image21_lora):
diffusers' QwenImage21Pipeline loads LoRAs through the same QwenImageLoraLoaderMixin, and 2.1's
module names are its diffusers names (img_mlp.gate_layer, txt_in.in_layer, modulation.1, ...); the
kohya tables hold Qwen-Image's names only, so 2.1's own flattened names are unknown keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from mmgen.errors import ValidationError
from mmgen.lora.form import LoRAContents, LoRATarget, LowRank
from mmgen.lora.readers import parse_diffusers

PAIR_SUFFIXES = (("lora_down.weight", "lora_up.weight"), ("lora_A.weight", "lora_B.weight"))
SUFFIXES = ("lora_down.weight", "lora_up.weight", "lora_A.weight", "lora_B.weight", "alpha")
# kohya's flattened block-layer names -> the dotted ones.
FLAT_LEAVES = (
    ("attn_to_q", "attn.to_q"),
    ("attn_to_k", "attn.to_k"),
    ("attn_to_v", "attn.to_v"),
    ("attn_to_out_0", "attn.to_out.0"),
    ("attn_add_q_proj", "attn.add_q_proj"),
    ("attn_add_k_proj", "attn.add_k_proj"),
    ("attn_add_v_proj", "attn.add_v_proj"),
    ("attn_to_add_out", "attn.to_add_out"),
    ("img_mlp_net_0_proj", "img_mlp.net.0.proj"),
    ("img_mlp_net_2", "img_mlp.net.2"),
    ("txt_mlp_net_0_proj", "txt_mlp.net.0.proj"),
    ("txt_mlp_net_2", "txt_mlp.net.2"),
    ("img_mod_1", "img_mod.1"),
    ("txt_mod_1", "txt_mod.1"),
)
FLAT_TOP = (
    ("img_in", "img_in"),
    ("txt_in", "txt_in"),
    ("proj_out", "proj_out"),
    ("norm_out_linear", "norm_out.linear"),
    ("time_text_embed_timestep_embedder_linear_1", "time_text_embed.timestep_embedder.linear_1"),
    ("time_text_embed_timestep_embedder_linear_2", "time_text_embed.timestep_embedder.linear_2"),
)
_FLAT_BLOCK = re.compile(r"transformer_blocks_(\d+)_(\w+)")


def flat_module(flat: str) -> str | None:
    """A kohya flat name (after "lora_unet_") -> the dotted module name, or None if unknown.

    "transformer_blocks_3_attn_add_k_proj" -> "transformer_blocks.3.attn.add_k_proj".
    """
    top = dict(FLAT_TOP).get(flat)
    if top is not None:
        return top
    match = _FLAT_BLOCK.fullmatch(flat)
    leaf = None if match is None else dict(FLAT_LEAVES).get(match.group(2))
    return None if leaf is None else f"transformer_blocks.{match.group(1)}.{leaf}"


def parse_qwen_image_lora(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, source: str = "<dict>"
) -> LoRAContents:
    """A Qwen-Image LoRA state dict (and its safetensors metadata) -> LoRAContents (see the module docstring)."""
    if not state:
        raise ValidationError(f"LoRA file {source!r} holds no tensors")
    keys = [key.replace(".default.", ".") for key in state]
    if all(key.startswith("transformer.") for key in keys) and not any(
        key.endswith(".alpha") for key in keys
    ):
        return parse_diffusers(dict(zip(keys, state.values(), strict=True)), metadata, source=source)
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unknown: list[str] = []
    for original, key in zip(state, keys, strict=True):
        module, suffix = _split(key)
        if module is None:
            unknown.append(original)
            continue
        groups.setdefault(module, {})[suffix] = (original, state[original])
    targets = []
    for module, parts in groups.items():
        target = _target(module, parts, source)
        if target is None:
            unknown.extend(key for key, _ in parts.values())
        else:
            targets.append(target)
    fmt = "kohya" if any(key.startswith("lora_unet_") for key in keys) else "qwen-image"
    return LoRAContents(fmt, tuple(targets), (), tuple(unknown), ())


def _split(key: str) -> tuple[str | None, str]:
    """A key -> (dotted module name or None, suffix)."""
    suffix = next((s for s in SUFFIXES if key.endswith("." + s)), None)
    if suffix is None:
        return None, ""
    name = key[: -len(suffix) - 1]
    if name.startswith("lora_unet_"):
        return flat_module(name.removeprefix("lora_unet_")), suffix
    for prefix in ("diffusion_model.", "transformer."):
        name = name.removeprefix(prefix)
    return name, suffix


def _target(module: str, parts: dict[str, tuple[str, torch.Tensor]], source: str) -> LoRATarget | None:
    """The low-rank target of one module's keys, or None when they hold no pair."""
    old, new = (any(suffix in parts for suffix in pair) for pair in PAIR_SUFFIXES)
    if old and new:
        raise ValidationError(
            f"LoRA file {source!r}: module {module} has both lora_down/lora_up and lora_A/lora_B keys"
        )
    if not (old or new):
        return None  # an alpha with no pair to scale
    pair = PAIR_SUFFIXES[0] if old else PAIR_SUFFIXES[1]
    down_suffix, up_suffix = pair
    if down_suffix not in parts or up_suffix not in parts:
        present = parts.get(down_suffix, parts.get(up_suffix))[0]
        raise ValidationError(
            f"LoRA file {source!r}: key {present} has no matching half of its low-rank pair"
        )
    (down_key, down), (up_key, up) = parts[down_suffix], parts[up_suffix]
    if not (down.is_floating_point() and up.is_floating_point()):
        raise ValidationError(f"LoRA file {source!r}: keys {down_key} / {up_key} must be floating point")
    if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValidationError(
            f"LoRA file {source!r}: key {down_key} {tuple(down.shape)} and {up_key} {tuple(up.shape)} "
            "are not a low-rank pair [rank, in] / [out, rank]"
        )
    rank = int(down.shape[0])
    alpha = None
    if "alpha" in parts:
        alpha_key, value = parts["alpha"]
        if value.numel() != 1:
            raise ValidationError(
                f"LoRA file {source!r}: key {alpha_key} must be a scalar, got {tuple(value.shape)}"
            )
        alpha = float(value.float().item())
    scale = 1.0 if alpha is None else alpha / rank
    used = tuple(key for key, _ in parts.values())
    if not math.isfinite(scale):
        raise ValidationError(f"LoRA file {source!r}: module {module} has a non-finite scale {scale}")
    return LoRATarget(
        weight=f"{module}.weight",
        bias=None,
        low_rank=LowRank(down=down, up=up, alpha=alpha, scale=scale),
        weight_delta=None,
        bias_delta=None,
        bias_scale=1.0,
        keys=used,
    )
