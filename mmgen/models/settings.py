"""How one model call executes: a frozen value passed down, like DiTAttention (DESIGN.md).

The pipeline's plan builds one `ExecutionSettings` per request and passes it to every DiT call
(`WanDiT.forward(..., settings=)`), which hands it to every block; nothing about a call is
written onto a module. Two calls with different settings on one model therefore cannot see each
other's choices, however they interleave.

- ffn_chunk / block_chunk: tokens per range of the FFN / of the whole block (a memory plan's
  chunks; exact: every op they split is per token); None = the whole sequence.
- fp8_layers: the linear layer kinds that run in FP8 (mmgen.layers.fp8_linear.FP8_LAYER_KINDS;
  lossy); empty = none. The quantized weights are cached per layer (Fp8WeightCache), re-made only
  when the weight changes, so a call without FP8 leaves them and the next FP8 call reuses them.
- fp8_attention: self-attention on e4m3 q/k/v (mmgen.attention.fp8; lossy).
- block_stream: blocks -> the same blocks, each bound to device copies of its weights while it
  runs (a layer-offload placement's mmgen.placement.BlockStream); None = the weights stay put.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import check_fp8_layers

BlockStreamFn = Callable[[Sequence[Any]], Iterable[Any]]


@dataclass(frozen=True)
class ExecutionSettings:
    """One request's execution choices for its model calls (see the module docstring)."""

    ffn_chunk: int | None = None
    block_chunk: int | None = None
    fp8_layers: frozenset[str] = frozenset()
    fp8_attention: bool = False
    block_stream: BlockStreamFn | None = None

    def __post_init__(self) -> None:
        for name in ("ffn_chunk", "block_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValidationError(f"{name} = {value!r}: must be a positive integer or None")
        object.__setattr__(self, "fp8_layers", check_fp8_layers(self.fp8_layers))
        if not isinstance(self.fp8_attention, bool):
            raise ValidationError(f"fp8_attention = {self.fp8_attention!r}: must be true or false")

    def blocks(self, blocks: Sequence[Any]) -> Iterable[Any]:
        """The blocks a forward runs, in order: as they are, or through the block stream."""
        return blocks if self.block_stream is None else self.block_stream(blocks)

    def describe(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict (the block stream as whether there is one)."""
        return {
            "ffn_chunk": self.ffn_chunk,
            "block_chunk": self.block_chunk,
            "fp8_layers": sorted(self.fp8_layers),
            "fp8_attention": self.fp8_attention,
            "block_stream": self.block_stream is not None,
        }
