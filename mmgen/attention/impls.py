"""Diffusion attention implementations: FlashAttention through a kernel provider, and torch SDPA.

Every impl takes q, k, v as [B, S, H, D] plus an AttentionMetadata and returns [B, Sq, H, D]. Dense
when the metadata's cu_seqlens are None. With cu_seqlens_q / cu_seqlens_k, row b of the padded
tensors holds its valid tokens first (len_b = cu[b + 1] - cu[b]); padded keys are never attended,
padded query positions output zeros. The result equals packing each row's valid tokens to varlen,
running `flash_attn_varlen_func` and unpacking; the kernels read the rows in place instead
(cu_seqlens over the padded row starts plus `seqused_k`), so no gather, no scatter and no host sync.
FA2 alone has no `seqused_k`: with per-row key lengths it gathers the valid keys (one host sync).
Impls never mutate the metadata or its tensors.

An impl whose `writes_out` is True also takes `out=`: a [B, Sq, H, D] view with any row stride (last
dimension contiguous) that the result is written into and returned as. The caller hands in the
columns of a wider row buffer, whose spare columns the "concat" LoRA kernel then fills
(mmgen.layers.low_rank). FA3 (fa3-fwd) writes there directly (its raw op takes the output's row
stride); the reference copies (a CPU path). Impls without the attribute are called without `out`.

FlashAttention providers, in `auto` order: FA3 (`flash_attn_interface`, or `fa3_fwd_interface` from
the fa3-fwd package), FA4 (`flash_attn.cute`, package flash-attn-4), FA2 (`flash_attn`), and the pure
torch reference `mmgen.kernels.flash_attn` (the CPU path, and the fallback when none is installed).
The GPU kernels take bfloat16/float16 CUDA tensors only: anything else raises a ValidationError
rather than silently running another kernel, so the reported provider is always the one that ran.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.kernels import flash_attn as reference_kernels

GPU_PROVIDERS = ("fa3", "fa4", "fa2")
PROVIDERS = (*GPU_PROVIDERS, "reference")
# (provider, modules tried in order, what to install when none imports)
PROVIDER_MODULES = (
    (
        "fa3",
        ("flash_attn_interface", "fa3_fwd_interface"),
        "pip install fa3-fwd (or flash-attention's hopper/ build)",
    ),
    ("fa4", ("flash_attn.cute",), "pip install flash-attn-4"),
    ("fa2", ("flash_attn",), "pip install flash-attn"),
)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@runtime_checkable
class AttentionImpl(Protocol):
    """q, k, v [B, S, H, D] + metadata -> out [B, Sq, H, D]; `name` is the backend, `provider` the kernel that runs."""

    name: str
    provider: str

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor: ...


def row_lengths(cu_seqlens: torch.Tensor | None, batch: int, field: str) -> torch.Tensor | None:
    """Valid lengths int32 [B] from cumulative lengths [B + 1] (None stays None: the dense shape)."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != batch + 1:
        raise ValidationError(
            f"AttentionMetadata.{field} has shape {tuple(cu_seqlens.shape)}, expected ({batch + 1},) for batch {batch}"
        )
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)


def zero_padded_queries(out: torch.Tensor, lengths_q: torch.Tensor | None) -> torch.Tensor:
    """out [B, Sq, H, D] with positions >= lengths_q[b] set to 0 (where, not multiply: kernels may leave NaN there)."""
    if lengths_q is None:
        return out
    valid = torch.arange(out.shape[1], device=out.device)[None, :] < lengths_q[:, None]
    return torch.where(valid[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _written(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """result, or out with result copied into it when an out is given."""
    return result if out is None else out.copy_(result)


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


def _first(result: torch.Tensor | tuple) -> torch.Tensor:
    # FA3 builds return out or (out, lse) depending on version; FA4 always returns (out, lse).
    return result[0] if isinstance(result, tuple) else result


@dataclass(frozen=True)
class KernelProvider:
    """One FlashAttention library: its dense and varlen entry points and calling conventions."""

    name: str
    module: str
    flash_attn_func: Callable
    flash_attn_varlen_func: Callable
    on_gpu: bool
    has_seqused_k: bool
    # The library's raw forward op that writes into a given `out` (fa3-fwd's torch.ops.fa3_fwd.fwd),
    # None where it has none we use: then `out` is filled by a copy.
    forward_into: Callable | None = None

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D], every key attended (written into `out` if given)."""
        if out is not None and self.forward_into is not None:
            return self._into(q, k, v, out, scale)
        return _written(_first(self.flash_attn_func(q, k, v, softmax_scale=scale, causal=False)), out)

    def padded_keys(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths_k: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like dense, but row b attends only its first lengths_k[b] keys (int32 [B])."""
        batch, seq_q, heads, head_dim = q.shape
        seq_k = k.shape[1]
        if not self.has_seqused_k:
            return _written(self._packed_keys(q, k, v, lengths_k, scale), out)
        # Rows stay where they are: cu_seqlens give the padded row starts, seqused_k the valid counts.
        cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (batch + 1) * seq_k, seq_k, dtype=torch.int32, device=q.device)
        if out is not None and self.forward_into is not None:
            # [B, Sq, H, D] with row stride W -> [B * Sq, H, D], still a view (batch stride = Sq * W).
            self._into(
                q.reshape(batch * seq_q, heads, head_dim),
                k.reshape(batch * seq_k, *k.shape[2:]),
                v.reshape(batch * seq_k, *v.shape[2:]),
                out.view(batch * seq_q, heads, -1),
                scale,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=seq_q,
                max_seqlen_k=seq_k,
                seqused_k=lengths_k.contiguous(),
            )
            return out
        result = self.flash_attn_varlen_func(
            q.reshape(batch * seq_q, heads, head_dim),
            k.reshape(batch * seq_k, *k.shape[2:]),
            v.reshape(batch * seq_k, *v.shape[2:]),
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=seq_q,
            max_seqlen_k=seq_k,
            seqused_k=lengths_k.contiguous(),
            softmax_scale=scale,
            causal=False,
        )
        return _written(_first(result).reshape(batch, seq_q, heads, -1), out)

    def _into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float, **varlen
    ) -> torch.Tensor:
        """forward_into with the arguments fa3-fwd's own flash_attn_func / varlen wrappers pass (the same
        kernel and tiling, so the same bits), plus out; q and k get a contiguous last dimension, v
        too unless its heads are (as the wrappers do)."""
        q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
        v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
        self.forward_into(
            q,
            k,
            v,
            out=out,
            softmax_scale=scale,
            is_causal=False,
            is_rotary_interleaved=True,
            num_splits=1,
            **varlen,
        )
        return out

    def _packed_keys(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths_k: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # FA2 has no seqused_k: gather the valid keys into a packed layout (a host sync, FA2 only).
        batch, seq_q, heads, head_dim = q.shape
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < lengths_k[:, None]
        cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=q.device)
        cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=k.device)
        cu_k[1:] = torch.cumsum(lengths_k, 0)
        out = self.flash_attn_varlen_func(
            q.reshape(batch * seq_q, heads, head_dim),
            k[valid],
            v[valid],
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=seq_q,
            max_seqlen_k=k.shape[1],
            softmax_scale=scale,
            causal=False,
        )
        return _first(out).reshape(batch, seq_q, heads, -1)


def reference_provider() -> KernelProvider:
    """The pure-torch reference of the flash-attn contract (mmgen.kernels.flash_attn)."""
    return KernelProvider(
        name="reference",
        module=reference_kernels.__name__,
        flash_attn_func=reference_kernels.flash_attn_func,
        flash_attn_varlen_func=reference_kernels.flash_attn_varlen_func,
        on_gpu=False,
        has_seqused_k=True,
    )


def load_provider(name: str) -> KernelProvider | None:
    """The named provider if its library imports here, else None ("reference" always loads)."""
    if name == "reference":
        return reference_provider()
    for provider, modules, _ in PROVIDER_MODULES:
        if provider != name:
            continue
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except (
                ImportError,
                OSError,
                RuntimeError,
            ):  # a broken CUDA build fails with OSError/RuntimeError
                continue
            dense = getattr(module, "flash_attn_func", None)
            varlen = getattr(module, "flash_attn_varlen_func", None)
            # flash-attn-4 alone leaves `flash_attn` a namespace package without these functions.
            if dense is None or varlen is None:
                continue
            return KernelProvider(
                provider,
                module_name,
                dense,
                varlen,
                on_gpu=True,
                has_seqused_k=name != "fa2",
                forward_into=_fa3_forward_into(module_name),
            )
        return None
    raise ValidationError(f"unknown FlashAttention provider {name!r}; allowed: auto, {', '.join(PROVIDERS)}")


def install_hint(name: str) -> str:
    """What to install for a GPU provider."""
    return next(hint for provider, _, hint in PROVIDER_MODULES if provider == name)


def installed_gpu_providers() -> tuple[str, ...]:
    """GPU FlashAttention providers whose libraries import here, in preference order."""
    return tuple(name for name in GPU_PROVIDERS if load_provider(name) is not None)


class FlashAttentionImpl:
    """FlashAttention through one kernel provider (see the module docstring for the order and rules)."""

    name = "flash"

    def __init__(self, provider: str = "auto") -> None:
        if provider == "auto":
            kernel = None
            if torch.cuda.is_available():
                kernel = next(filter(None, (load_provider(name) for name in GPU_PROVIDERS)), None)
            kernel = kernel or reference_provider()
        else:
            kernel = load_provider(provider)
            if kernel is None:
                raise ValidationError(
                    f"attention provider {provider!r} is not installed; {install_hint(provider)}"
                )
        self.kernel = kernel
        self.provider = kernel.name

    def __repr__(self) -> str:
        return f"FlashAttentionImpl(provider={self.provider!r}, module={self.kernel.module!r})"

    @property
    def writes_out(self) -> bool:
        """Whether callers should hand in `out=` (module docstring): FA3 writes it directly; the
        reference (CPU) copies into it, so the padded-output path runs on CPU as well."""
        return self.kernel.forward_into is not None or not self.kernel.on_gpu

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D] in q's dtype; with `out` (a [B, Sq, H, D]
        view, last dimension contiguous, q's dtype) the result is written there and out is returned."""
        if self.kernel.on_gpu and (not q.is_cuda or q.dtype not in KERNEL_DTYPES):
            raise ValidationError(
                f"FlashAttention provider {self.provider!r} needs bfloat16/float16 CUDA tensors, got "
                f"{q.dtype} on {q.device}; use the 'sdpa' backend or 'flash:reference'"
            )
        if out is not None:
            expected = (*q.shape[:-1], v.shape[-1])
            if tuple(out.shape) != expected or out.stride(-1) != 1 or out.dtype != q.dtype:
                raise ValueError(
                    f"attention out= {tuple(out.shape)} {out.dtype} stride {out.stride()}: expected "
                    f"{expected} {q.dtype} with a contiguous last dimension"
                )
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        lengths_q = row_lengths(meta.cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        lengths_k = row_lengths(meta.cu_seqlens_k, q.shape[0], "cu_seqlens_k")
        if lengths_k is None:
            result = self.kernel.dense(q, k, v, scale, out)
        else:
            result = self.kernel.padded_keys(q, k, v, lengths_k, scale, out)
        if out is None or lengths_q is None:
            return zero_padded_queries(result, lengths_q)
        return out.copy_(zero_padded_queries(out, lengths_q))  # padded queries: rare, a copy is fine


class SDPAImpl:
    """torch.nn.functional.scaled_dot_product_attention (torch picks cuDNN / flash / efficient / math)."""

    name = "sdpa"
    provider = "sdpa"

    def __repr__(self) -> str:
        return "SDPAImpl()"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D]; padded keys masked by a boolean key mask."""
        lengths_q = row_lengths(meta.cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        lengths_k = row_lengths(meta.cu_seqlens_k, q.shape[0], "cu_seqlens_k")
        mask = None
        if lengths_k is not None:
            keys = torch.arange(k.shape[1], device=k.device)[None, :] < lengths_k[:, None]
            mask = keys[:, None, None, :]  # [B, 1, 1, Sk], True = attend
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=k.shape[2] != q.shape[2],
        ).transpose(1, 2)
        if lengths_k is not None:
            # A row with no valid key is NaN in SDPA; the varlen contract gives zeros.
            has_keys = (lengths_k > 0)[:, None, None, None]
            out = torch.where(has_keys, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return zero_padded_queries(out, lengths_q)
