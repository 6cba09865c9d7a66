"""Padded rows as varlen: the one helper between [B, S, H, D] rows and the packed form varlen kernels take.

Row b of a padded tensor holds its valid tokens first (len_b of S). A varlen kernel takes packed
[total, H, D] tensors plus int32 cu_seqlens [B + 1]. Keys are packed one of two ways:
- in place (kernels with `seqused_k`: FA3, FA4, the reference): a reshape to [B * Sk, Hk, D],
  cu_seqlens_k over the padded row starts and seqused_k = the valid counts; no copy, no host sync;
- gathered (kernels without `seqused_k`: FA2): only the valid keys, cu_seqlens_k from their lengths
  (boolean indexing: one host sync).
Queries always stay in place ([B * Sq, H, D]): padded query rows are computed, and zeroing or
dropping them is the caller's business. `PackedRows.rows` turns a packed result back into rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def row_starts(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens int32 [B + 1] of `batch` rows of `length` tokens each: 0, length, 2 * length, ..."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class PackedRows:
    """q, k, v of padded rows in varlen form, the varlen call's length keywords, and the way back."""

    q: torch.Tensor  # [B * Sq, H, D]
    k: torch.Tensor  # [B * Sk, Hk, D] in place, [sum(lengths_k), Hk, D] gathered
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: torch.Tensor | None  # int32 [B]: valid keys per row (in place with lengths), else None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def keywords(self) -> dict[str, Any]:
        """cu_seqlens_q/k, max_seqlen_q/k and seqused_k, as the varlen entry points name them."""
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            seqused_k=self.seqused_k,
        )

    def rows(self, packed: torch.Tensor) -> torch.Tensor:
        """A packed per-query result [B * Sq, H, Dv] -> [B, Sq, H, Dv]."""
        return packed.reshape(self.batch, self.max_seqlen_q, *packed.shape[1:])

    def lse_rows(self, lse: torch.Tensor) -> torch.Tensor:
        """A varlen LSE [H, B * Sq] -> [B, H, Sq] (the batched kernels' LSE layout)."""
        return lse.reshape(lse.shape[0], self.batch, self.max_seqlen_q).transpose(0, 1)


def pack_padded_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths_k: torch.Tensor | int | None = None,
    *,
    gather_keys: bool = False,
) -> PackedRows:
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] with row b's first lengths_k[b] keys valid -> PackedRows.

    lengths_k: int32 [B], one int for every row, or None (every key valid: dense). gather_keys packs
    only the valid keys (for kernels without seqused_k); otherwise the keys stay in place.
    """
    batch, seq_q = q.shape[:2]
    seq_k = k.shape[1]
    flat_q = q.reshape(batch * seq_q, *q.shape[2:])
    cu_q = row_starts(batch, seq_q, q.device)
    if isinstance(lengths_k, int):
        lengths_k = torch.full((batch,), lengths_k, dtype=torch.int32, device=q.device)
    if lengths_k is not None and gather_keys:
        valid = torch.arange(seq_k, device=k.device)[None, :] < lengths_k[:, None]
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=k.device)
        cu_k[1:] = torch.cumsum(lengths_k, 0)
        return PackedRows(flat_q, k[valid], v[valid], cu_q, cu_k, seq_q, seq_k, None)
    flat_k = k.reshape(batch * seq_k, *k.shape[2:])
    flat_v = v.reshape(batch * seq_k, *v.shape[2:])
    used = None if lengths_k is None else lengths_k.to(torch.int32).contiguous()
    return PackedRows(flat_q, flat_k, flat_v, cu_q, row_starts(batch, seq_k, k.device), seq_q, seq_k, used)
