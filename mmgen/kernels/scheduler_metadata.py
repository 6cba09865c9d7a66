"""FA3 scheduler metadata: the reference's opaque int32 tensor records what it was computed for.

FA3's `get_scheduler_metadata` precomputes a split schedule once per batch; `flash_attn_with_kvcache`
then reuses it in every layer. The reference encodes the call's parameters instead, so that a kvcache
call given metadata computed for another batch, window, softcap or split count raises
KernelContractError (on the GPU it would silently run the wrong schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.kernels.contract import KernelContractError, require_int32, window_bounds

_SCHEDULER_MAGIC = 0x4D4D5343  # "MMSC": marks tensors made by get_scheduler_metadata below
_SCHEDULER_HEADER = (
    "batch_size",
    "max_seqlen_q",
    "max_seqlen_k",
    "num_heads_q",
    "num_heads_kv",
    "headdim",
    "headdim_v",
    "page_size",
    "causal",
    "window_left",
    "window_right",
    "attention_chunk",
    "has_softcap",
    "num_splits",
    "pack_gqa",
    "max_seqlen_k_new",
    "has_cu_seqlens_q",
    "has_cu_seqlens_k_new",
    "has_cache_leftpad",
)


@dataclass(frozen=True)
class SchedulerMetadataInfo:
    """What one scheduler-metadata tensor was computed for (the reference's metadata encodes exactly this).

    Tensor layout (int32, 1-D): [magic, the 19 header fields in `_SCHEDULER_HEADER` order,
    cache_seqlens (batch_size), cu_seqlens_q (batch_size + 1, zeros if none), cache_leftpad
    (batch_size, zeros if none)]. window is canonical: -1 = unbounded, right = 0 when causal, and
    causal is set exactly when (left, right) == (-1, 0), as FA3 canonicalizes it. page_size 0 means a
    contiguous cache; pack_gqa -1 means None (heuristic).
    """

    batch_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_heads_q: int
    num_heads_kv: int
    headdim: int
    headdim_v: int
    page_size: int
    causal: bool
    window_left: int
    window_right: int
    attention_chunk: int
    has_softcap: bool
    num_splits: int
    pack_gqa: int
    max_seqlen_k_new: int
    has_cu_seqlens_q: bool
    has_cu_seqlens_k_new: bool
    has_cache_leftpad: bool
    cache_seqlens: tuple[int, ...]
    cu_seqlens_q: tuple[int, ...]
    cache_leftpad: tuple[int, ...]

    def to_tensor(self, device: torch.device | str) -> torch.Tensor:
        """Encode as the opaque int32 metadata tensor."""
        header = [int(getattr(self, name)) for name in _SCHEDULER_HEADER]
        values = [_SCHEDULER_MAGIC, *header, *self.cache_seqlens, *self.cu_seqlens_q, *self.cache_leftpad]
        return torch.tensor(values, dtype=torch.int32, device=device)

    @classmethod
    def from_tensor(cls, metadata: torch.Tensor) -> SchedulerMetadataInfo:
        """Decode a tensor made by get_scheduler_metadata; KernelContractError for anything else."""
        values = metadata.tolist() if metadata.dim() == 1 and metadata.dtype == torch.int32 else []
        n_header = len(_SCHEDULER_HEADER)
        if len(values) < 1 + n_header or values[0] != _SCHEDULER_MAGIC:
            raise KernelContractError(
                "scheduler_metadata was not made by mmgen.kernels.scheduler_metadata.get_scheduler_metadata "
                f"(dtype {metadata.dtype}, shape {list(metadata.shape)})"
            )
        fields = dict(zip(_SCHEDULER_HEADER, values[1 : 1 + n_header], strict=True))
        batch = fields["batch_size"]
        rest = values[1 + n_header :]
        if len(rest) != 3 * batch + 1:
            raise KernelContractError(
                f"scheduler_metadata holds {len(rest)} values after its header, not {3 * batch + 1}"
            )
        for flag in (
            "causal",
            "has_softcap",
            "has_cu_seqlens_q",
            "has_cu_seqlens_k_new",
            "has_cache_leftpad",
        ):
            fields[flag] = bool(fields[flag])
        return cls(
            **fields,
            cache_seqlens=tuple(rest[:batch]),
            cu_seqlens_q=tuple(rest[batch : 2 * batch + 1]),
            cache_leftpad=tuple(rest[2 * batch + 1 :]),
        )


def _canonical_window(causal: bool, window_size: Sequence[int | None] | None) -> tuple[bool, int, int]:
    """FA3's canonical (causal, left, right): -1 unbounded, causal <=> (-1, 0)."""
    left, right = window_bounds(window_size)
    left = -1 if left is None else left
    right = -1 if right is None else right
    if causal:
        right = 0
    return (left < 0 and right == 0), left, right


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    headdim: int,
    cache_seqlens: torch.Tensor,
    qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_size: int | None = None,
    max_seqlen_k_new: int = 0,
    causal: bool = False,
    window_size: Sequence[int | None] = (-1, -1),
    attention_chunk: int = 0,
    has_softcap: bool = False,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> torch.Tensor:
    """FA3 signature. cache_seqlens int32 [B] -> opaque int32 metadata (see SchedulerMetadataInfo).

    The reference flash_attn_with_kvcache validates a metadata tensor against its call and raises when
    it was computed for another batch size, lengths, heads, page size, window, softcap or split count.
    """
    require_int32("cache_seqlens", cache_seqlens, (batch_size,))
    require_int32("cu_seqlens_q", cu_seqlens_q, (batch_size + 1,))
    require_int32("cu_seqlens_k_new", cu_seqlens_k_new, (batch_size + 1,))
    require_int32("cache_leftpad", cache_leftpad, (batch_size,))
    is_causal, left, right = _canonical_window(causal, window_size)
    info = SchedulerMetadataInfo(
        batch_size=batch_size,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        headdim=headdim,
        headdim_v=headdim if headdim_v is None else headdim_v,
        page_size=page_size or 0,
        causal=is_causal,
        window_left=left,
        window_right=right,
        attention_chunk=attention_chunk,
        has_softcap=bool(has_softcap),
        num_splits=num_splits,
        pack_gqa=-1 if pack_gqa is None else int(pack_gqa),
        max_seqlen_k_new=max_seqlen_k_new,
        has_cu_seqlens_q=cu_seqlens_q is not None,
        has_cu_seqlens_k_new=cu_seqlens_k_new is not None,
        has_cache_leftpad=cache_leftpad is not None,
        cache_seqlens=tuple(cache_seqlens.tolist()),
        cu_seqlens_q=tuple(cu_seqlens_q.tolist()) if cu_seqlens_q is not None else (0,) * (batch_size + 1),
        cache_leftpad=tuple(cache_leftpad.tolist()) if cache_leftpad is not None else (0,) * batch_size,
    )
    return info.to_tensor(cache_seqlens.device)


def describe_scheduler_metadata(metadata: torch.Tensor) -> SchedulerMetadataInfo:
    """What a reference scheduler-metadata tensor was computed for (for tests and error messages)."""
    return SchedulerMetadataInfo.from_tensor(metadata)


def check_scheduler_metadata(
    metadata: torch.Tensor, expected: torch.Tensor, longest_k: int, longest_new: int
) -> None:
    """Raise unless `metadata` matches `expected` (get_scheduler_metadata of the call being made).

    The key bounds only need to cover the call: max_seqlen_k / max_seqlen_k_new may exceed the
    longest key / appended count, every other field must be equal.
    """
    got = SchedulerMetadataInfo.from_tensor(metadata)
    want = SchedulerMetadataInfo.from_tensor(expected)
    exact = [name for name in _SCHEDULER_HEADER if name not in ("max_seqlen_k", "max_seqlen_k_new")]
    exact += ["cache_seqlens", "cu_seqlens_q", "cache_leftpad"]
    wrong = [
        f"{n}: metadata {getattr(got, n)} vs call {getattr(want, n)}"
        for n in exact
        if getattr(got, n) != getattr(want, n)
    ]
    if got.max_seqlen_k < longest_k:
        wrong.append(f"max_seqlen_k: metadata {got.max_seqlen_k} < longest key count {longest_k}")
    if got.max_seqlen_k_new < longest_new:
        wrong.append(
            f"max_seqlen_k_new: metadata {got.max_seqlen_k_new} < longest appended count {longest_new}"
        )
    if wrong:
        raise KernelContractError(
            "scheduler_metadata was computed for a different call (compute it once per batch for each "
            "distinct layer kind, e.g. one for sliding-window layers and one for global ones): "
            + "; ".join(wrong)
        )
