"""LoRA files -> LoRAContents (mmgen.lora.form): one pure function per format, one file reader.

Formats (picked by the keys' prefix, never guessed per key):
- diffusers / PEFT: `transformer.<module>.lora_A.weight`, `.lora_B.weight`, optional `.lora_B.bias`
  (PEFT's lora_bias). Alpha is not in the tensors: diffusers writes the PEFT LoraConfig as JSON
  into the safetensors metadata (`lora_adapter_metadata`, keys prefixed "transformer."); the scale
  is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), alpha_pattern overriding per module.
  Without that metadata diffusers takes alpha = rank: scale 1.
- original Wan / ComfyUI / lightx2v: `diffusion_model.<module>.lora_down.weight` / `.lora_up.weight`
  (or lora_A / lora_B), optional `.alpha` (scale alpha / rank, else 1), and the distillation LoRAs'
  full deltas `.diff` (weight) and `.diff_b` (bias), both applied at scale 1.
- kohya / musubi-tuner: `lora_unet_<module with underscores>.lora_down.weight` etc., as the original.
A delta that is all zeros changes nothing and is ignored with that reason (the lightx2v files carry
one for every norm). Keys no rule maps are returned as `unknown`: the application refuses them
unless the caller allows unmatched keys.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mmgen.errors import LoadError, ValidationError
from mmgen.lora.form import LoRAContents, LoRATarget, LowRank
from mmgen.lora.names import is_image_target, musubi_module, original_parameter
from mmgen.outputs.writers import file_sha256

METADATA_KEY = "lora_adapter_metadata"  # where diffusers' save_lora_weights puts the LoraConfig
ORIGINAL_SUFFIXES = (
    "lora_down.weight",
    "lora_up.weight",
    "lora_A.weight",
    "lora_B.weight",
    "alpha",
    "diff_b",
    "diff",
)
DIFFUSERS_SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_B.bias")
ZERO_REASON = "all-zero delta (changes nothing; lightx2v writes one for every norm)"


@dataclass(frozen=True)
class LoRAFile:
    """A LoRA file read from disk: its path, sha256 of the bytes, and parsed contents."""

    path: Path
    sha256: str
    contents: LoRAContents


def read_lora_file(path: Path | str) -> LoRAFile:
    """Read a .safetensors LoRA; a missing, truncated or malformed file is a LoadError naming it."""
    path = Path(path)
    if not path.is_file():
        raise LoadError(f"LoRA file {str(path)!r} not found")
    if path.suffix != ".safetensors":
        raise LoadError(f"LoRA file {str(path)!r}: only .safetensors files are read (no pickles)")
    sha256 = file_sha256(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise LoadError(f"LoRA file {str(path)!r} cannot be read: {err}") from err
    return LoRAFile(path=path, sha256=sha256, contents=parse_lora(state, metadata, source=str(path)))


def parse_lora(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, source: str = "<dict>"
) -> LoRAContents:
    """A LoRA state dict (and its safetensors metadata) -> LoRAContents; the format is picked by prefix."""
    if not state:
        raise ValidationError(f"LoRA file {source!r} holds no tensors")
    keys = list(state)
    if any(k.startswith("diffusion_model.") for k in keys):
        return parse_original(state, source=source)
    if any(k.startswith("lora_unet_") for k in keys):
        return parse_musubi(state, source=source)
    if any(k.startswith("transformer.") for k in keys):
        return parse_diffusers(state, metadata, source=source)
    raise ValidationError(
        f"LoRA file {source!r}: unknown key layout (first keys: {', '.join(keys[:3])}); "
        "known: transformer.* (diffusers/PEFT), diffusion_model.* (Wan/ComfyUI), lora_unet_* (kohya/musubi)"
    )


def parse_original(state: Mapping[str, torch.Tensor], *, source: str = "<dict>") -> LoRAContents:
    """Original Wan / ComfyUI / lightx2v keys (`diffusion_model.<module>.<suffix>`) -> LoRAContents."""
    groups, unknown = _group(state, "diffusion_model.", ORIGINAL_SUFFIXES, lambda name: name)
    return _build(groups, unknown, "wan", source)


def parse_musubi(state: Mapping[str, torch.Tensor], *, source: str = "<dict>") -> LoRAContents:
    """kohya / musubi-tuner keys (`lora_unet_<flat module>.<suffix>`) -> LoRAContents."""
    groups, unknown = _group(state, "lora_unet_", ORIGINAL_SUFFIXES, musubi_module)
    return _build(groups, unknown, "musubi", source)


def parse_diffusers(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, source: str = "<dict>"
) -> LoRAContents:
    """diffusers / PEFT keys (`transformer.<module>.lora_A.weight` ...) -> LoRAContents."""
    config = _peft_config(metadata, source)
    if config.get("use_dora"):
        raise ValidationError(f"LoRA file {source!r}: DoRA adapters (use_dora) are not supported")
    groups, unknown = _group(state, "transformer.", DIFFUSERS_SUFFIXES, lambda name: name)
    targets, image_keys = [], []
    for module, parts in groups.items():
        keys = tuple(key for key, _ in parts.values())
        down, up = _pair(parts, "lora_A.weight", "lora_B.weight", source)
        if down is None:
            unknown.extend(keys)
            continue
        rank = int(down.shape[0])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha"))
        expected_rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r"))
        if expected_rank is not None and int(expected_rank) != rank:
            raise ValidationError(
                f"LoRA file {source!r}: key {parts['lora_A.weight'][0]} has rank {rank}, "
                f"but its metadata says r={expected_rank}"
            )
        alpha = float(rank if alpha is None else alpha)
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        bias = parts.get("lora_B.bias")
        target = LoRATarget(
            weight=f"{module}.weight",
            bias=f"{module}.bias" if bias is not None else None,
            low_rank=LowRank(down=down, up=up, alpha=alpha, scale=scale),
            weight_delta=None,
            bias_delta=None if bias is None else _float(bias[1], source, bias[0]),
            bias_scale=scale,  # PEFT scales lora_B's bias with the same factor
            keys=keys,
        )
        targets.append(target)
        if is_image_target(target.weight):
            image_keys.extend(keys)
    return LoRAContents("diffusers", tuple(targets), (), tuple(unknown), tuple(image_keys))


def _group(state, prefix, suffixes, rename):
    """{original module name: {suffix: (key, tensor)}} and the keys that fit no (prefix, suffix, name) rule."""
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unknown: list[str] = []
    for key, tensor in state.items():
        suffix = next((s for s in suffixes if key.endswith("." + s)), None)
        if not key.startswith(prefix) or suffix is None:
            unknown.append(key)
            continue
        module = rename(key[len(prefix) : -len(suffix) - 1])
        if module is None:
            unknown.append(key)
            continue
        groups.setdefault(module, {})[suffix] = (key, tensor)
    return groups, unknown


def _build(groups, unknown: list[str], fmt: str, source: str) -> LoRAContents:
    """Original-layout groups -> LoRAContents (shared by the Wan/ComfyUI and kohya/musubi readers)."""
    targets, ignored, image_keys = [], [], []
    for module, parts in groups.items():
        keys = tuple(key for key, _ in parts.values())
        names = original_parameter(module)
        if names is None:
            unknown.extend(keys)
            continue
        weight_name, bias_name = names
        pair_suffixes = ("lora_down.weight", "lora_up.weight")
        if "lora_A.weight" in parts or "lora_B.weight" in parts:
            if "lora_down.weight" in parts or "lora_up.weight" in parts:
                raise ValidationError(
                    f"LoRA file {source!r}: module {module} has both lora_down/lora_up and lora_A/lora_B keys"
                )
            pair_suffixes = ("lora_A.weight", "lora_B.weight")
        down, up = _pair(parts, *pair_suffixes, source)
        alpha = None
        if "alpha" in parts:
            key, value = parts["alpha"]
            if down is None:
                unknown.append(key)  # an alpha with no pair to scale
            elif value.numel() != 1:
                raise ValidationError(
                    f"LoRA file {source!r}: key {key} must be a scalar, got {tuple(value.shape)}"
                )
            else:
                alpha = float(value.float().item())
        weight_delta = _delta(parts, "diff", source, ignored)
        bias_delta = _delta(parts, "diff_b", source, ignored)
        if bias_delta is not None and bias_name is None:
            unknown.append(parts["diff_b"][0])
            bias_delta = None
        consumed = (pair_suffixes if down is not None else ()) + ("alpha",) * (alpha is not None)
        consumed += ("diff",) * (weight_delta is not None) + ("diff_b",) * (bias_delta is not None)
        used = tuple(parts[suffix][0] for suffix in consumed)
        if down is None and weight_delta is None and bias_delta is None:
            continue  # every key of this module was ignored or unknown
        low_rank = None
        if down is not None:
            rank = int(down.shape[0])
            low_rank = LowRank(down=down, up=up, alpha=alpha, scale=1.0 if alpha is None else alpha / rank)
        target = LoRATarget(
            weight=weight_name,
            bias=bias_name if bias_delta is not None else None,
            low_rank=low_rank,
            weight_delta=weight_delta,
            bias_delta=bias_delta,
            bias_scale=1.0,
            keys=used,
        )
        targets.append(target)
        if is_image_target(weight_name):
            image_keys.extend(used)
    return LoRAContents(fmt, tuple(targets), tuple(ignored), tuple(unknown), tuple(image_keys))


def _pair(parts, down_suffix: str, up_suffix: str, source: str):
    """(down [r, in], up [out, r]) float tensors, (None, None) if absent; half a pair or bad shapes raise."""
    if down_suffix not in parts and up_suffix not in parts:
        return None, None
    if down_suffix not in parts or up_suffix not in parts:
        present, missing = (down_suffix, up_suffix) if down_suffix in parts else (up_suffix, down_suffix)
        raise ValidationError(f"LoRA file {source!r}: key {parts[present][0]} has no matching {missing}")
    (down_key, down), (up_key, up) = parts[down_suffix], parts[up_suffix]
    down, up = _float(down, source, down_key), _float(up, source, up_key)
    if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValidationError(
            f"LoRA file {source!r}: key {down_key} {tuple(down.shape)} and {up_key} {tuple(up.shape)} "
            "are not a low-rank pair [rank, in] / [out, rank] (only Linear layers take low-rank deltas)"
        )
    return down, up


def _delta(parts, suffix: str, source: str, ignored: list[tuple[str, str]]) -> torch.Tensor | None:
    if suffix not in parts:
        return None
    key, tensor = parts[suffix]
    tensor = _float(tensor, source, key)
    if not bool(tensor.any()):
        ignored.append((key, ZERO_REASON))
        return None
    return tensor


def _float(tensor: torch.Tensor, source: str, key: str = "") -> torch.Tensor:
    if not tensor.is_floating_point():
        raise LoadError(
            f"LoRA file {source!r}: key {key} has dtype {tensor.dtype}; LoRA tensors must be floating point"
        )
    return tensor


def _peft_config(metadata: Mapping[str, str] | None, source: str) -> dict:
    """The transformer's LoraConfig fields from diffusers' safetensors metadata ({} when absent)."""
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as err:
        raise LoadError(f"LoRA file {source!r}: metadata {METADATA_KEY} is not JSON ({err})") from err
    return {k.removeprefix("transformer."): v for k, v in packed.items() if k.startswith("transformer.")}


def _pattern_value(patterns: Mapping[str, object], module: str, default: object) -> object:
    """PEFT's rank/alpha_pattern lookup: the first pattern that matches the module name's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
