"""The one internal form every LoRA file format is read into.

A LoRA is data applied to named parameters of a transformer (names in mmgen's = diffusers'
WanTransformer3DModel naming). Per target weight it holds at most: a low-rank pair (down, up) with
the scale its format defines, a full weight delta (`.diff`) and a bias delta (`.diff_b`, or PEFT's
`lora_B.bias`). The readers produce it; application (mmgen.lora.apply) consumes only this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowRank:
    """delta W = scale * up @ down; down [rank, in], up [out, rank]; alpha as the file gave it (or None)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None
    scale: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass(frozen=True)
class LoRATarget:
    """Everything one LoRA file changes about one weight (and its bias).

    weight: the parameter name, e.g. "blocks.0.attn1.to_q.weight" (or "blocks.0.scale_shift_table").
    bias: the bias parameter the bias delta goes to, or None. The applied change at strength s is
    W += s * (low_rank.scale * up @ down + weight_delta), b += s * bias_scale * bias_delta.
    keys: the file's keys this target was read from (for the report and error messages).
    """

    weight: str
    bias: str | None
    low_rank: LowRank | None
    weight_delta: torch.Tensor | None
    bias_delta: torch.Tensor | None
    bias_scale: float
    keys: tuple[str, ...]

    @property
    def module(self) -> str:
        """The module the weight belongs to ("blocks.0.attn1.to_q")."""
        return self.weight.removesuffix(".weight")


@dataclass(frozen=True)
class LoRAContents:
    """A parsed LoRA file: its format, targets, keys left aside and why, keys nothing could read.

    ignored: (key, reason) for keys deliberately not applied (e.g. all-zero norm deltas).
    unknown: keys whose names no rule of the format maps to a model weight (unmatched).
    image_keys: keys that target the image cross-attention / image embedder (I2V-only layers).
    """

    format: str
    targets: tuple[LoRATarget, ...]
    ignored: tuple[tuple[str, str], ...]
    unknown: tuple[str, ...]
    image_keys: tuple[str, ...]

    @property
    def key_count(self) -> int:
        return sum(len(t.keys) for t in self.targets) + len(self.ignored) + len(self.unknown)
