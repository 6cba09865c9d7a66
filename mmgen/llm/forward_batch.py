"""What one forward step of the encoder-decoder runtime computes: its mode and its batch layout.

seq_lens convention (DESIGN.md): `seq_lens[i]` is request i's decoder KV length after this step's
tokens are written, EXCEPT in DRAFT_EXTEND_V2, where it is the prefix length before the step and the
extent a kernel must read is `seq_lens + extend_seq_lens` (max = max_i(prefix_i + extend_i)).

Memory layout: `req_to_token[req, col] -> KV slot` (int32). An encoder-decoder request's row holds its
encoder slots first (`encoder_lens[i]` columns), then its decoder slots; the allocator starts the
decoder part on a fresh page, so the decoder page table of row i is the per-row gather
`req_to_token[req_i, encoder_lens[i] + p * page_size] // page_size` (never one batch-wide offset).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # prefill: new tokens appended after an optional cached prefix
    DECODE = enum.auto()  # one new token per request
    MIXED = enum.auto()  # extend and decode requests in one batch (decode = extend of length 1)
    IDLE = enum.auto()  # no tokens (a rank with nothing to do still runs the step)
    TARGET_VERIFY = enum.auto()  # target model scores draft_token_num tokens per request, causally
    DRAFT_EXTEND_V2 = enum.auto()  # draft model catches up on accepted tokens; seq_lens = prefix

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend_like(self) -> bool:
        """Modes whose kernels take several query tokens per request."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND_V2,
        )


@dataclass(frozen=True)
class SpecInfo:
    """Speculative-decoding facts a backend needs: how many draft tokens each request carries."""

    draft_token_num: int


@dataclass
class ForwardBatch:
    """The layout of one step. Tensors live on the model's device; *_cpu copies avoid host syncs.

    req_pool_indices: int64 [B] rows of req_to_token.
    seq_lens / seq_lens_cpu: int32 [B] decoder KV lengths (see the module docstring's convention).
    extend_seq_lens / extend_prefix_lens (+ _cpu): int32 [B] new tokens and cached prefix per request
        (extend-like modes; in DECODE both are None).
    out_cache_loc: int64 [num_tokens] KV slots this step's tokens are written to.
    encoder_lens / encoder_lens_cpu: int32 [B] each request's own encoder length (None: decoder-only).
    positions: int64 [num_tokens] RoPE positions of this step's tokens.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: torch.Tensor | None = None
    encoder_lens: torch.Tensor | None = None
    encoder_lens_cpu: torch.Tensor | None = None
    spec_info: SpecInfo | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.numel())

    def query_lens_cpu(self) -> torch.Tensor:
        """Query tokens per request this step, on the host: 1 in DECODE, extend_seq_lens in extend-like
        modes (TARGET_VERIFY without extend_seq_lens: spec_info.draft_token_num each), 0 in IDLE."""
        if self.forward_mode is ForwardMode.DECODE:
            return torch.ones(self.batch_size, dtype=torch.int32)
        if self.forward_mode is ForwardMode.IDLE:
            return torch.zeros(self.batch_size, dtype=torch.int32)
        if self.extend_seq_lens_cpu is not None:
            return self.extend_seq_lens_cpu
        if self.forward_mode is ForwardMode.TARGET_VERIFY and self.spec_info is not None:
            return torch.full((self.batch_size,), self.spec_info.draft_token_num, dtype=torch.int32)
        raise ValueError(f"{self.forward_mode.name} batch without extend_seq_lens_cpu")

    def kv_extent_cpu(self) -> torch.Tensor:
        """Per-request decoder KV length the kernels must read, on the host (the seq_lens convention)."""
        if self.forward_mode is ForwardMode.DRAFT_EXTEND_V2:
            assert self.extend_seq_lens_cpu is not None
            return self.seq_lens_cpu + self.extend_seq_lens_cpu
        return self.seq_lens_cpu
