"""The DiT call contract every model family follows: one forward signature, one record for its blocks.

A family's DiT (WanDiT, WanVACEDiT, QwenImageTransformer, ...) is called as

    model(latents, timestep, text, *, attention, text_lens=None, metadata=None, parallel=None,
          settings=None, **conditioning) -> prediction

- latents, timestep, text: the tokens in (the family's packing; its docstring gives the shapes).
- attention: the AttentionImpl every attention site of the call runs.
- text_lens [B]: each prompt's token count, or None (every text token is attended).
- metadata: the call's attention metadata, when the caller built it already (the family's type:
  Wan's DiTAttention, Qwen-Image's JointTokens); None = built from text_lens at the top of forward.
  Give one of metadata and text_lens.
- parallel: the ParallelLayout (mmgen.parallel.layout) the call runs under; None = one rank.
- settings: the request's ExecutionSettings (chunks, FP8, block stream); None = the defaults.
- conditioning: the family's own keywords (Wan: image_embeds; VACE: control, control_scale,
  control_metadata; Qwen-Image: grids).

At its top, forward builds one frozen record (a subclass of DiTCall, once per call) and hands it
to every block: `block(tokens, call)` (Wan) or `block(image, text, call)` (dual-stream Qwen-Image).
A block reads what it needs from the record, never from a global or an attribute set for the call;
the streams a block updates are its arguments, what stays fixed for the call is in the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgen.attention.impls import AttentionImpl
from mmgen.models.settings import ExecutionSettings


@dataclass(frozen=True, kw_only=True)
class DiTCall:
    """What every block of one model call reads, built once at the top of forward; never mutated.

    attention: the impl of every attention site (under sequence parallelism, the sharded wrapper);
    metadata: the call's attention metadata (the family's type, see the module docstring);
    rope: the call's RoPE tables (the family's form); temb: the timestep embedding [B or N, dim];
    settings: how the call executes (mmgen.models.settings).
    """

    attention: AttentionImpl
    metadata: Any
    rope: Any
    temb: torch.Tensor
    settings: ExecutionSettings = ExecutionSettings()
