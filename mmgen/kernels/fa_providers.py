"""The FlashAttention provider layer: one adapter per library, their availability probing, and the loader.

Every FlashAttention call in mmgen (the diffusion impls, ring attention, the LLM backend) goes through
a provider: the pure-torch reference (mmgen.kernels.flash_attn), FA3 (`flash_attn_interface`, or
`fa3_fwd_interface` from fa3-fwd), FA4 (`flash_attn.cute`, package flash-attn-4) or FA2 (`flash_attn`).
They share one set of methods, so the same caller code runs on the references (CPU) and the kernels:
- flash_attn_func(q, k, v, **kw) -> out: dense [B, S, H, D] attention (the library's keywords);
- flash_attn_varlen_func(q, k, v, **VarlenArgs) -> out, or (out, lse [Hq, total_q]) with return_lse;
- flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, **FA3 keywords) -> out or (out, lse);
- get_scheduler_metadata(...) -> FA3's scheduler metadata, or None where the library needs none;
- flash_attn_into(q, k, v, out, ...) -> out: the library's raw forward op writing into an `out` of any
  row stride (fa3-fwd only: `forward_into` is None elsewhere).
Attributes say what each can do: on_gpu, has_seqused_k (FA2 has none: callers gather keys, see
mmgen.kernels.varlen), supports_paged_kv, supports_window; `module` names the library that runs.

`probe_provider(name)` imports a library (None when it does not import here), `installed_gpu_providers()`
lists those that do, `load_flash_attention_provider` picks one for a device/dtype and feature set.
"""

from __future__ import annotations

import abc
import collections
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

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
    flash_attn_func,
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
    uses -1 for unbounded; return_lse gives (out, lse [Hq, total_q]) instead of out. seqused_q [B]: request
    b computes only its first seqused_q[b] query rows from cu_seqlens_q[b] (the other rows are left
    unwritten: garbage on the GPU kernels); where it is given, providers without seqused_k refuse it too.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    seqused_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    softmax_scale: float | None = None
    causal: bool = False
    window_size: Sequence[int | None] = (-1, -1)
    softcap: float = 0.0
    return_lse: bool = False


@runtime_checkable
class FlashAttentionProvider(Protocol):
    """What callers of FlashAttention use (module docstring). Every implementation counts its calls in `calls`.

    Keywords past the positional arguments have the names and meanings of the reference functions.
    Windows use -1 for unbounded on every provider (the FA4 adapter converts to FA4's None).
    """

    name: str
    module: str
    calls: collections.Counter
    on_gpu: bool
    has_seqused_k: bool
    supports_paged_kv: bool
    supports_window: bool
    forward_into: Callable | None

    def flash_attn_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor: ...

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
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

    def flash_attn_into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor: ...


def _first(result: torch.Tensor | tuple) -> torch.Tensor:
    """The output alone: builds return out or (out, lse, ...) depending on version and library."""
    return result[0] if isinstance(result, tuple) else result


def _unbounded_as_minus_one(window_size: Sequence[int | None]) -> tuple[int, ...]:
    return tuple(-1 if w is None else w for w in window_size)


class _CountingProvider(abc.ABC):
    """What the providers share: the call counter, the dense and into entry points, and the FA3 heads of
    get_scheduler_metadata and flash_attn_with_kvcache (each provider supplies the library call behind them)."""

    name = "abstract"
    module = "abstract"
    on_gpu = True
    has_seqused_k = True
    supports_paged_kv = True
    supports_window = True

    def __init__(self, forward_into: Callable | None = None) -> None:
        self.calls: collections.Counter = collections.Counter()
        # The library's raw forward op that writes into a given `out` (fa3-fwd's torch.ops.fa3_fwd.fwd),
        # None where it has none: callers then copy the result into their `out`.
        self.forward_into = forward_into

    def __repr__(self) -> str:
        return f"{type(self).__name__}(module={self.module!r})"

    def _count(self, entry: str) -> None:
        # Not while torch.compile traces (compiled DiT blocks): a guard on the counter would make every
        # compiled caller recompile once after its first call.
        if not torch.compiler.is_compiling():
            self.calls[entry] += 1

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
        self._count("get_scheduler_metadata")
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
        self._count("flash_attn_with_kvcache")
        return self._with_kvcache(q, k_cache, v_cache, k, v, kwargs)

    def flash_attn_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """Dense attention q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> out [B, Sq, Hq, Dv] (the library's
        keywords, e.g. softmax_scale, causal, FA3's q/k/v_descale), counted."""
        self._count("flash_attn_func")
        return _first(self._dense(q, k, v, kwargs))

    def flash_attn_into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """forward_into(q, k, v, out=out) with the arguments fa3-fwd's own flash_attn_func / varlen
        wrappers pass (the same kernel and tiling, so the same bits): non-causal, num_splits=1, plus
        softmax_scale and the varlen keywords in kwargs. q and k get a contiguous last dimension, v
        too unless its heads are (as the wrappers do). Dense [B, S, H, D] or packed [total, H, D]."""
        if self.forward_into is None:
            raise KernelContractError(f"{self.module} has no forward op that writes into a given out")
        self._count("flash_attn_into")
        q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
        v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
        self.forward_into(
            q, k, v, out=out, is_causal=False, is_rotary_interleaved=True, num_splits=1, **kwargs
        )
        return out

    @abc.abstractmethod
    def _dense(self, q, k, v, kwargs: dict[str, Any]):
        """The library's flash_attn_func (arguments as the public method's; may return a tuple)."""

    @abc.abstractmethod
    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """The library's flash_attn_with_kvcache behind this provider (arguments as the public method's)."""


class ReferenceFlashAttention(_CountingProvider):
    """The pure-torch references behind the provider interface; `calls` counts each method's calls."""

    name = "reference"
    module = "mmgen.kernels.flash_attn"
    on_gpu = False

    def _scheduler_metadata(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return get_scheduler_metadata(*args, **kwargs)

    def _dense(self, q, k, v, kwargs: dict[str, Any]):
        return flash_attn_func(q, k, v, **kwargs)

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """See the module function `flash_attn_with_kvcache`."""
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See the module function `flash_attn_varlen_func`; keywords only past v."""
        self._count("flash_attn_varlen_func")
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

    def __init__(self, lib: Any, build_flags: dict[str, bool], forward_into: Callable | None = None) -> None:
        super().__init__(forward_into)
        self.lib = lib
        self.module = lib.__name__
        self.supports_paged_kv = not build_flags.get("FLASHATTENTION_DISABLE_PAGEDKV", False)
        self.supports_window = not build_flags.get("FLASHATTENTION_DISABLE_LOCAL", False)

    def _scheduler_metadata(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.lib.get_scheduler_metadata(*args, **kwargs)

    def _check(self, page_table: torch.Tensor | None, window_size: Sequence[int | None] | None) -> None:
        if page_table is not None and not self.supports_paged_kv:
            raise KernelContractError(
                f"{self.module} was built without paged KV (FLASHATTENTION_DISABLE_PAGEDKV)"
            )
        if _uses_window(window_size) and not self.supports_window:
            raise KernelContractError(
                f"{self.module} was built without sliding windows (FLASHATTENTION_DISABLE_LOCAL)"
            )

    def _dense(self, q, k, v, kwargs: dict[str, Any]):
        return self.lib.flash_attn_func(q, k, v, **kwargs)

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        """FA3's flash_attn_with_kvcache; returns out or (out, softmax_lse)."""
        self._check(kwargs.get("page_table"), kwargs.get("window_size"))
        res = self.lib.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
        return (res[0], res[1]) if kwargs.get("return_softmax_lse") else _first(res)

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Varlen attention (VarlenArgs keywords); a paged call goes through FA3's kvcache entry (its
        varlen one has no page_table)."""
        a = VarlenArgs(**kwargs)
        self._count("flash_attn_varlen_func")
        self._check(a.page_table, a.window_size)
        window = _unbounded_as_minus_one(a.window_size)
        common = dict(softmax_scale=a.softmax_scale, causal=a.causal, window_size=window, softcap=a.softcap)
        if a.page_table is not None:
            res = self.lib.flash_attn_with_kvcache(
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
            res = self.lib.flash_attn_varlen_func(
                q,
                k,
                v,
                a.cu_seqlens_q,
                a.cu_seqlens_k,
                a.max_seqlen_q,
                a.max_seqlen_k,
                seqused_q=a.seqused_q,
                seqused_k=a.seqused_k,
                return_attn_probs=a.return_lse,
                **common,
            )
        return (res[0], res[1]) if a.return_lse else _first(res)


class FA2FlashAttention(_CountingProvider):
    """Adapter over flash-attn 2 (`flash_attn`): dense and varlen only.

    FA2's varlen function has no seqused_k and no page table (callers gather the valid keys instead:
    mmgen.kernels.varlen) and the adapter maps no kvcache entry: those calls raise KernelContractError.
    Its varlen LSE is [Hq, total_q] (flash-attn >= 2.5).
    """

    name = "fa2"
    has_seqused_k = False
    supports_paged_kv = False

    def __init__(self, lib: Any) -> None:
        super().__init__()
        self.lib = lib
        self.module = lib.__name__

    def _dense(self, q, k, v, kwargs: dict[str, Any]):
        return self.lib.flash_attn_func(q, k, v, **kwargs)

    def _with_kvcache(self, q, k_cache, v_cache, k, v, kwargs: dict[str, Any]):
        raise KernelContractError(
            "the FA2 adapter has no flash_attn_with_kvcache (paged KV needs fa3 or fa4)"
        )

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA2's flash_attn_varlen_func (VarlenArgs keywords, no seqused_k / page_table)."""
        a = VarlenArgs(**kwargs)
        self._count("flash_attn_varlen_func")
        if a.seqused_k is not None or a.seqused_q is not None or a.page_table is not None:
            raise KernelContractError(
                "flash-attn 2 takes neither seqused_k, seqused_q nor page_table: pack the valid rows "
                "(mmgen.kernels.varlen.pack_padded_rows(..., gather_keys=True))"
            )
        extra: dict[str, Any] = {}  # passed only when set: older FA2 releases lack softcap
        if _uses_window(a.window_size):
            extra["window_size"] = _unbounded_as_minus_one(a.window_size)
        if a.softcap:
            extra["softcap"] = a.softcap
        res = self.lib.flash_attn_varlen_func(
            q,
            k,
            v,
            a.cu_seqlens_q,
            a.cu_seqlens_k,
            a.max_seqlen_q,
            a.max_seqlen_k,
            softmax_scale=a.softmax_scale,
            causal=a.causal,
            return_attn_probs=a.return_lse,
            **extra,
        )
        return (res[0], res[1]) if a.return_lse else _first(res)


class FA4FlashAttention(_CountingProvider):
    """Adapter over flash-attn-4's `flash_attn.cute` (4.0.0b36: flash_attn_varlen_func with page_table +
    seqused_k, and flash_attn_func for dense calls).

    FA4 has no kvcache entry: flash_attn_with_kvcache maps onto its varlen function (cache_seqlens ->
    seqused_k; new k/v are written into the caller's cache first by the same torch code the reference
    uses). It runs with num_splits=1 (FA4 has no split-KV on sm90), where FA4 needs no scheduler
    metadata: get_scheduler_metadata returns None (still counted) and flash_attn_with_kvcache accepts
    only None. FA4 returns (out, lse) from every call; the adapter returns out alone unless asked.
    """

    name = "fa4"
    module = "flash_attn.cute"

    def __init__(self, varlen_func: Any, dense_func: Any | None = None) -> None:
        super().__init__()
        self.varlen_func = varlen_func
        self.dense_func = dense_func

    def _dense(self, q, k, v, kwargs: dict[str, Any]):
        if self.dense_func is None:
            raise KernelContractError("this FA4 adapter was built without flash_attn_func")
        return self.dense_func(q, k, v, **kwargs)

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
            seqused_q=a.seqused_q,
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
        self._count("flash_attn_varlen_func")
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


GPU_PROVIDERS = ("fa3", "fa4", "fa2")  # the auto order
PROVIDER_NAMES = (*GPU_PROVIDERS, "reference")
INSTALL_HINTS = MappingProxyType(
    {
        "fa3": "pip install fa3-fwd (or build flash-attention's hopper/)",
        "fa4": "pip install flash-attn-4",
        "fa2": "pip install flash-attn",
    }
)
# Where each GPU provider's library may live, tried in order, and the entry points it must have
# (flash-attn-4 alone leaves `flash_attn` a namespace package without them).
_LIBRARIES = MappingProxyType(
    {
        "fa3": ("flash_attn_interface", "fa3_fwd_interface"),
        "fa4": ("flash_attn.cute",),
        "fa2": ("flash_attn",),
    }
)
_ENTRY_POINTS = ("flash_attn_func", "flash_attn_varlen_func")
_FA3_CONFIGS = MappingProxyType(
    {"flash_attn_interface": "flash_attn_config", "fa3_fwd_interface": "fa3_fwd_config"}
)


def _check_name(name: str) -> None:
    if name not in ("auto", *PROVIDER_NAMES):
        raise ValidationError(
            f"unknown FlashAttention provider {name!r}; allowed: auto, {', '.join(PROVIDER_NAMES)}"
        )


def _fa3_forward_into(module_name: str) -> Callable | None:
    """fa3-fwd's raw forward op (schema `fwd(q, k, v, ..., Tensor(out!)? out, ...)`), which takes an
    output of any row stride. Its Python wrappers never pass one, and their custom op may not return
    an input, so the op is called directly. Other FA3 builds: None (their raw ops are not checked)."""
    if module_name != "fa3_fwd_interface":
        return None
    try:
        return torch.ops.fa3_fwd.fwd
    except (AttributeError, RuntimeError):
        return None


def _adapter(name: str, module_name: str, lib: Any) -> _CountingProvider:
    if name == "fa4":
        return FA4FlashAttention(lib.flash_attn_varlen_func, lib.flash_attn_func)
    if name == "fa2":
        return FA2FlashAttention(lib)
    try:
        flags = dict(importlib.import_module(_FA3_CONFIGS[module_name]).CONFIG.get("build_flags", {}))
    except (ImportError, AttributeError):
        flags = {}  # builds without a config module have every feature
    return FA3FlashAttention(lib, flags, _fa3_forward_into(module_name))


def import_provider(name: str) -> FlashAttentionProvider:
    """The named provider over its library; KernelUnavailableError (what failed, what to install) when
    the library does not import here. No device check: see load_flash_attention_provider."""
    _check_name(name)
    if name == "reference":
        return ReferenceFlashAttention()
    if name == "auto":
        raise ValidationError("import_provider needs a provider name, not 'auto'")
    reasons = []
    for module_name in _LIBRARIES[name]:
        try:
            lib = importlib.import_module(module_name)
        except (ImportError, OSError, RuntimeError) as err:  # a broken CUDA build: OSError/RuntimeError
            reasons.append(f"{module_name}: {err}")
            continue
        missing = [entry for entry in _ENTRY_POINTS if not hasattr(lib, entry)]
        if missing:
            reasons.append(f"{module_name} has no {', '.join(missing)}")
            continue
        return _adapter(name, module_name, lib)
    raise KernelUnavailableError(
        f"FlashAttention provider {name!r} is not installed ({INSTALL_HINTS[name]}): " + "; ".join(reasons)
    )


def probe_provider(name: str) -> FlashAttentionProvider | None:
    """The named provider if its library imports here, else None ("reference" always does)."""
    try:
        return import_provider(name)
    except KernelUnavailableError:
        return None


def installed_gpu_providers() -> tuple[str, ...]:
    """GPU providers whose libraries import here, in auto order (FA3, FA4, FA2)."""
    return tuple(name for name in GPU_PROVIDERS if probe_provider(name) is not None)


def _missing_features(provider: FlashAttentionProvider, paged_kv: bool, window: bool) -> list[str]:
    asked = (
        ("paged KV", paged_kv, provider.supports_paged_kv),
        ("sliding window", window, provider.supports_window),
    )
    return [feature for feature, wanted, has in asked if wanted and not has]


def load_flash_attention_provider(
    name: str = "auto",
    *,
    paged_kv: bool = False,
    window: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> FlashAttentionProvider:
    """The provider called `name` ("auto" | "fa3" | "fa4" | "fa2" | "reference") for use on this machine.

    "auto": for data on a CUDA device in bf16/fp16 (device/dtype of the tensors it will see; None =
    not known, assume CUDA when present) the first of FA3 (on sm90), FA4 and FA2 that is installed
    and supports what is asked (paged_kv, window), else the reference: the real kernels take neither
    CPU tensors nor fp32. A named GPU provider that is missing, has no CUDA device, or lacks an
    asked-for feature raises KernelUnavailableError.
    """
    _check_name(name)
    if name == "reference":
        return ReferenceFlashAttention()
    has_cuda = torch.cuda.is_available()
    if name != "auto":
        if not has_cuda:
            raise KernelUnavailableError(
                f"FlashAttention provider {name!r} needs a CUDA device; none is available"
            )
        provider = import_provider(name)
        missing = _missing_features(provider, paged_kv, window)
        if missing:
            raise KernelUnavailableError(
                f"FlashAttention provider {name!r} is built without {' and '.join(missing)}"
            )
        return provider
    if has_cuda and gpu_kernels_apply(device, dtype):
        for candidate in GPU_PROVIDERS:
            if candidate == "fa3" and torch.cuda.get_device_capability()[0] != 9:
                continue
            provider = probe_provider(candidate)
            if provider is not None and not _missing_features(provider, paged_kv, window):
                return provider
    return ReferenceFlashAttention()
