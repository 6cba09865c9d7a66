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
In eager code FA3's raw op runs without an `out` too, into a fresh output (`_raw_forward`).

FlashAttention kernels come from the one provider layer, `mmgen.kernels.fa_providers`; in `auto`
order: FA3 (`flash_attn_interface`, or `fa3_fwd_interface` from the fa3-fwd package), FA4
(`flash_attn.cute`, package flash-attn-4), FA2 (`flash_attn`), and the pure torch reference
`mmgen.kernels.flash_attn` (the CPU path, and the fallback when none is installed). Padded rows become
varlen calls through `mmgen.kernels.varlen`. The GPU kernels take bfloat16/float16 CUDA tensors only:
anything else raises a ValidationError rather than silently running another kernel, so the reported
provider is always the one that ran.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.kernels.contract import KERNEL_DTYPES
from mmgen.kernels.fa_providers import (
    INSTALL_HINTS,
    FlashAttentionProvider,
    ReferenceFlashAttention,
    installed_gpu_providers,
    probe_provider,
)
from mmgen.kernels.varlen import pack_padded_rows


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


def dense_attention(
    kernel: FlashAttentionProvider,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> [B, Sq, H, D], every key attended (written into `out` if given)."""
    if _raw_forward(kernel, out):
        out = _new_output(q, v) if out is None else out
        return kernel.flash_attn_into(q, k, v, out, softmax_scale=scale)
    return _written(kernel.flash_attn_func(q, k, v, softmax_scale=scale, causal=False), out)


def _raw_forward(kernel: FlashAttentionProvider, out: torch.Tensor | None) -> bool:
    """Whether to call the kernel's raw forward op (fa3-fwd's): always when given an `out`, and in eager
    code without one. fa3-fwd's Python wrappers are torch.library custom ops, whose first call imports
    torch._dynamo and sympy (~830 modules: ~1 s, ~3-4 s on a host without cached bytecode, in every
    process's first step); the raw op is the same kernel with the same arguments, so the same bits
    (tests/test_lora_concat.py::test_fa3_writes_padded_rows_bitwise_on_cuda). A compiled graph keeps
    the wrapper when no `out` is given: its custom op is what torch.compile traces."""
    if kernel.forward_into is None:
        return False
    return out is not None or not torch.compiler.is_compiling()


def _new_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output [..., S, H, Dv] of q [..., S, H, D] attending values v [..., L, H, Dv]."""
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def padded_keys_attention(
    kernel: FlashAttentionProvider,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths_k: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Like dense_attention, but row b attends only its first lengths_k[b] keys (int32 [B]): the rows
    stay in place (seqused_k), or the valid keys are gathered where the kernel has no seqused_k (FA2)."""
    rows = pack_padded_rows(q, k, v, lengths_k, gather_keys=not kernel.has_seqused_k)
    if _raw_forward(kernel, out) and rows.seqused_k is not None:
        out = _new_output(q, v) if out is None else out
        # [B, Sq, H, D] with row stride W -> [B * Sq, H, D], still a view (batch stride = Sq * W).
        flat_out = out.view(rows.q.shape[0], q.shape[2], -1)
        kernel.flash_attn_into(rows.q, rows.k, rows.v, flat_out, softmax_scale=scale, **rows.keywords())
        return out
    result = kernel.flash_attn_varlen_func(
        rows.q, rows.k, rows.v, **rows.keywords(), softmax_scale=scale, causal=False
    )
    return _written(rows.rows(result), out)


class FlashAttentionImpl:
    """FlashAttention through one kernel provider (see the module docstring for the order and rules)."""

    name = "flash"

    def __init__(self, provider: str = "auto") -> None:
        if provider == "auto":
            installed = installed_gpu_providers() if torch.cuda.is_available() else ()
            kernel = probe_provider(installed[0]) if installed else None
        else:
            kernel = probe_provider(provider)
            if kernel is None:
                raise ValidationError(
                    f"attention provider {provider!r} is not installed; {INSTALL_HINTS[provider]}"
                )
        self.kernel: FlashAttentionProvider = kernel or ReferenceFlashAttention()
        self.provider = self.kernel.name

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
            result = dense_attention(self.kernel, q, k, v, scale, out)
        else:
            result = padded_keys_attention(self.kernel, q, k, v, lengths_k, scale, out)
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
