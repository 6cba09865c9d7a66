"""FlashAttention providers: one object per library (reference, FA3, FA4) with the same methods.

Backends call kernels through a provider (`load_flash_attention_provider`), so the same backend code
runs on the references (CPU) and on FA3 / FA4 (GPU). The keyword contract is written once:
`flash_attn_with_kvcache` takes the keywords of FA3's function (the reference's signature, normalised by
`kvcache_arguments`), `flash_attn_varlen_func` those of `VarlenArgs`.
"""

from __future__ import annotations

import abc
import collections
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmgen.errors import ValidationError
from mmgen.kernels.contract import (
    KernelContractError,
    KernelUnavailableError,
    cu_bounds,
    gpu_kernels_apply,
    reject_unsupported,
    window_bounds,
)
from mmgen.kernels.flash_attn import (
    CacheLayout,
    append_new_kv,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from mmgen.kernels.scheduler_metadata import get_scheduler_metadata

# FA3's flash_attn_with_kvcache keywords and defaults, read once from the reference (an immutable Signature).
_KVCACHE_SIGNATURE = inspect.signature(flash_attn_with_kvcache)


def kvcache_arguments(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    keywords: dict[str, Any],
) -> dict[str, Any]:
    """Every argument of an FA3 flash_attn_with_kvcache call by name, defaults filled in (TypeError for unknown)."""
    bound = _KVCACHE_SIGNATURE.bind(q, k_cache, v_cache, k, v, **keywords)
    bound.apply_defaults()
    return bound.arguments


@dataclass(frozen=True)
class VarlenArgs:
    """The keywords of a provider's flash_attn_varlen_func past (q, k, v): the part of FA3's and FA4's
    varlen signatures the backends use (the reference provider also takes the reference's others).

    Paged calls pass page_table [B, max_pages] int32 + seqused_k [B] and no cu_seqlens_k; window_size
    uses -1 for unbounded; return_lse gives (out, lse [Hq, total_q]) instead of out.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    seqused_k: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    softmax_scale: float | None = None
    causal: bool = False
    window_size: Sequence[int | None] = (-1, -1)
    softcap: float = 0.0
    return_lse: bool = False


class FlashAttentionProvider(Protocol):
    """What a FlashAttention backend calls. Every implementation counts its calls in `calls`.

    Methods (keywords past the positional ones; the same names and meanings as the reference functions):
    - flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, <FA3 keywords>) -> out, or
      (out, softmax_lse) when return_softmax_lse=True (always a pair: FA3's extra accumulators dropped).
    - flash_attn_varlen_func(q, k, v, *, <VarlenArgs keywords>) -> out, or (out, lse [Hq, total_q]).
    - get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
      headdim, cache_seqlens, *, <FA3 keywords>) -> an opaque tensor to pass as scheduler_metadata,
      or None where the library needs none (FA4).
    Windows use -1 for unbounded on every provider (the FA4 adapter converts to FA4's None).
    """

    name: str
    calls: collections.Counter
    supports_paged_kv: bool
    supports_window: bool

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor | None: ...


class _CountingProvider(abc.ABC):
    """What the three providers share: the call counter, and the FA3 heads of get_scheduler_metadata and
    flash_attn_with_kvcache (each provider supplies the library call behind them)."""

    name = "abstract"

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def _scheduler_metadata(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """The library's get_scheduler_metadata (None where the library needs no metadata)."""
        return None

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        """FA3's get_scheduler_metadata (a tensor for flash_attn_with_kvcache's scheduler_metadata), counted."""
        self.calls["get_scheduler_metadata"] += 1
        return self._scheduler_metadata(
            batch_size,
            max_seqlen_q,
            max_seqlen_k,
            num_heads_q,
            num_heads_kv,
            headdim,
            cache_seqlens,
            **kwargs,
        )

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA3's flash_attn_with_kvcache (keywords only past v); out, or (out, softmax_lse), counted."""
        self.calls["flash_attn_with_kvcache"] += 1
        return self._with_kvcache(q, k_cache, v_cache, k, v, kwargs)

    @abc.abstractmethod
    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """The library's flash_attn_with_kvcache behind this provider (arguments as the public method's)."""


class ReferenceFlashAttention(_CountingProvider):
    """The pure-torch references behind the provider interface; `calls` counts each method's calls."""

    name = "reference"
    supports_paged_kv = True
    supports_window = True

    def _scheduler_metadata(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return get_scheduler_metadata(*args, **kwargs)

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """See the module function `flash_attn_with_kvcache`."""
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See the module function `flash_attn_varlen_func`; keywords only past v."""
        self.calls["flash_attn_varlen_func"] += 1
        return flash_attn_varlen_func(q, k, v, **kwargs)


def _uses_window(window_size: Sequence[int | None] | None) -> bool:
    left, right = window_bounds(window_size)
    return left is not None or right is not None


class FA3FlashAttention(_CountingProvider):
    """Adapter over an FA3 module (`flash_attn_interface`, or `fa3_fwd_interface` from fa3-fwd 0.0.3).

    Build flags (fa3-fwd 0.0.3 has no paged KV and no local window) come from the module's config; a
    call needing a missing feature raises KernelContractError before reaching the library.
    """

    name = "fa3"

    def __init__(self, module: Any, build_flags: dict[str, bool]) -> None:
        super().__init__()
        self.module = module
        self.supports_paged_kv = not build_flags.get("FLASHATTENTION_DISABLE_PAGEDKV", False)
        self.supports_window = not build_flags.get("FLASHATTENTION_DISABLE_LOCAL", False)

    def _scheduler_metadata(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.module.get_scheduler_metadata(*args, **kwargs)

    def _check(self, page_table: torch.Tensor | None, window_size: Sequence[int | None] | None) -> None:
        module = self.module.__name__
        if page_table is not None and not self.supports_paged_kv:
            raise KernelContractError(f"{module} was built without paged KV (FLASHATTENTION_DISABLE_PAGEDKV)")
        if _uses_window(window_size) and not self.supports_window:
            raise KernelContractError(
                f"{module} was built without sliding windows (FLASHATTENTION_DISABLE_LOCAL)"
            )

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """FA3's flash_attn_with_kvcache; returns out or (out, softmax_lse)."""
        self._check(kwargs.get("page_table"), kwargs.get("window_size"))
        res = self.module.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
        return (res[0], res[1]) if kwargs.get("return_softmax_lse") else res

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Varlen attention (VarlenArgs keywords); a paged call goes through FA3's kvcache entry (its
        varlen one has no page_table)."""
        a = VarlenArgs(**kwargs)
        self.calls["flash_attn_varlen_func"] += 1
        self._check(a.page_table, a.window_size)
        window = tuple(-1 if w is None else w for w in a.window_size)
        common = dict(softmax_scale=a.softmax_scale, causal=a.causal, window_size=window, softcap=a.softcap)
        if a.page_table is not None:
            res = self.module.flash_attn_with_kvcache(
                q,
                k,
                v,
                cache_seqlens=a.seqused_k,
                page_table=a.page_table,
                cu_seqlens_q=a.cu_seqlens_q,
                max_seqlen_q=a.max_seqlen_q,
                return_softmax_lse=a.return_lse,
                **common,
            )
        else:
            res = self.module.flash_attn_varlen_func(
                q,
                k,
                v,
                a.cu_seqlens_q,
                a.cu_seqlens_k,
                a.max_seqlen_q,
                a.max_seqlen_k,
                seqused_k=a.seqused_k,
                return_attn_probs=a.return_lse,
                **common,
            )
        return (res[0], res[1]) if a.return_lse else res


class FA4FlashAttention(_CountingProvider):
    """Adapter over flash-attn-4's `flash_attn.cute.flash_attn_varlen_func` (4.0.0b36, page_table + seqused_k).

    FA4 has no kvcache entry: flash_attn_with_kvcache maps onto its varlen function (cache_seqlens ->
    seqused_k; new k/v are written into the caller's cache first by the same torch code the reference
    uses). It runs with num_splits=1 (FA4 has no split-KV on sm90), where FA4 needs no scheduler
    metadata: get_scheduler_metadata returns None (still counted) and flash_attn_with_kvcache accepts
    only None. FA4 returns (out, lse) from every call; the adapter returns out alone unless asked.
    """

    name = "fa4"
    supports_paged_kv = True
    supports_window = True

    def __init__(self, varlen_func: Any) -> None:
        super().__init__()
        self.varlen_func = varlen_func

    def _varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: VarlenArgs
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # FA4 means "unbounded" only by None: a lone -1 bound would be taken literally there.
        out, lse = self.varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=a.cu_seqlens_q,
            cu_seqlens_k=a.cu_seqlens_k,
            max_seqlen_q=a.max_seqlen_q,
            max_seqlen_k=a.max_seqlen_k,
            seqused_k=a.seqused_k,
            page_table=a.page_table,
            softmax_scale=a.softmax_scale,
            causal=a.causal,
            softcap=a.softcap,
            window_size=window_bounds(a.window_size),
            num_splits=1,
            return_lse=a.return_lse,
        )
        return (out, lse) if a.return_lse else out

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA4's flash_attn_varlen_func (VarlenArgs keywords); out, or (out, lse [Hq, total_q]) when return_lse."""
        a = VarlenArgs(**kwargs)
        self.calls["flash_attn_varlen_func"] += 1
        return self._varlen(q, k, v, a)

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """FA3's flash_attn_with_kvcache contract (minus rotary, qv, fp8, leftpad), run by FA4's varlen kernel."""
        a = kvcache_arguments(q, k_cache, v_cache, k, v, kwargs)
        unsupported = ("qv", "rotary_cos", "rotary_sin", "rotary_seqlens", "q_descale", "k_descale")
        unsupported += ("v_descale", "attention_chunk", "cache_leftpad", "scheduler_metadata")
        reject_unsupported(**{name: a[name] for name in unsupported})
        cu_seqlens_q, page_table, cache_batch_idx = a["cu_seqlens_q"], a["page_table"], a["cache_batch_idx"]
        batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
        paged = page_table is not None
        cache_seqlens = a["cache_seqlens"]
        if isinstance(cache_seqlens, int) or cache_seqlens is None:
            full = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
            length = full if cache_seqlens is None else cache_seqlens
            cache_seqlens = torch.full((batch,), length, dtype=torch.int32, device=q.device)
        rows = (
            tuple(cache_batch_idx.tolist())
            if cache_batch_idx is not None and not paged
            else tuple(range(batch))
        )
        seqused_k = cache_seqlens
        if k is not None:
            if a["cu_seqlens_k_new"] is not None:
                new = [(k[s:e], v[s:e]) for s, e in cu_bounds(a["cu_seqlens_k_new"])]
            else:
                new = [(k[b], v[b]) for b in range(batch)]
            ends = tuple(cache_seqlens.tolist())
            layout = CacheLayout(paged, k_cache.shape[1] if paged else 0, rows, (0,) * batch, ends)
            append_new_kv(k_cache, v_cache, new, layout, page_table)
            seqused_k = cache_seqlens + torch.tensor(
                [kb.shape[0] for kb, _ in new], dtype=torch.int32, device=q.device
            )
        if not paged and cache_batch_idx is not None:
            index = cache_batch_idx.long()
            k_cache, v_cache = k_cache[index], v_cache[index]
        varlen = VarlenArgs(
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=a["max_seqlen_q"],
            seqused_k=seqused_k,
            page_table=page_table,
            softmax_scale=a["softmax_scale"],
            causal=a["causal"],
            window_size=a["window_size"],
            softcap=a["softcap"],
            return_lse=a["return_softmax_lse"],
        )
        return self._varlen(q, k_cache, v_cache, varlen)


_PROVIDER_NAMES = ("auto", "fa3", "fa4", "reference")


def _load_fa3() -> FA3FlashAttention:
    reasons = []
    for module_name, config_name in (
        ("flash_attn_interface", "flash_attn_config"),
        ("fa3_fwd_interface", "fa3_fwd_config"),
    ):
        try:
            module = importlib.import_module(module_name)
        except (ImportError, OSError, RuntimeError) as err:
            reasons.append(f"{module_name}: {err}")
            continue
        try:
            flags = dict(importlib.import_module(config_name).CONFIG.get("build_flags", {}))
        except (ImportError, AttributeError):
            flags = {}  # builds without a config module have every feature
        return FA3FlashAttention(module, flags)
    raise KernelUnavailableError(
        "flash-attention provider 'fa3' is not installed (pip install fa3-fwd, or build flash-attention's hopper/): "
        + "; ".join(reasons)
    )


def _load_fa4() -> FA4FlashAttention:
    try:
        cute = importlib.import_module("flash_attn.cute")
        return FA4FlashAttention(cute.flash_attn_varlen_func)
    except (ImportError, OSError, RuntimeError, AttributeError) as err:
        raise KernelUnavailableError(
            f"flash-attention provider 'fa4' is not installed (pip install flash-attn-4): {err}"
        ) from err


def load_flash_attention_provider(
    name: str = "auto",
    *,
    paged_kv: bool = False,
    window: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ReferenceFlashAttention | FA3FlashAttention | FA4FlashAttention:
    """The provider called `name` ("auto" | "fa3" | "fa4" | "reference").

    "auto": for data on a CUDA device in bf16/fp16 (device/dtype of the tensors it will see; None =
    not known, assume CUDA when present) the first of FA3 (on sm90) and FA4 that is installed and
    supports what is asked (paged_kv, window), else the reference: the real kernels take neither CPU
    tensors nor fp32. A named GPU provider that is missing, has no CUDA device, or lacks an
    asked-for feature raises KernelUnavailableError.
    """
    if name not in _PROVIDER_NAMES:
        raise ValidationError(
            f"unknown flash-attention provider {name!r}: expected one of {', '.join(_PROVIDER_NAMES)}"
        )
    if name == "reference":
        return ReferenceFlashAttention()
    has_cuda = torch.cuda.is_available()
    if name != "auto":
        if not has_cuda:
            raise KernelUnavailableError(
                f"flash-attention provider {name!r} needs a CUDA device; none is available"
            )
        provider = _load_fa3() if name == "fa3" else _load_fa4()
        missing = [f for f, asked, has in (("paged KV", paged_kv, provider.supports_paged_kv), ("sliding window", window, provider.supports_window)) if asked and not has]  # fmt: skip
        if missing:
            raise KernelUnavailableError(
                f"flash-attention provider {name!r} is built without {' and '.join(missing)}"
            )
        return provider
    if has_cuda and gpu_kernels_apply(device, dtype):
        candidates = (("fa3", _load_fa3), ("fa4", _load_fa4))
        for cand, loader in candidates:
            if cand == "fa3" and torch.cuda.get_device_capability()[0] != 9:
                continue
            try:
                provider = loader()
            except KernelUnavailableError:
                continue
            if (paged_kv and not provider.supports_paged_kv) or (window and not provider.supports_window):
                continue
            return provider
    return ReferenceFlashAttention()
