"""Pick a diffusion attention impl by name, device, dtype and head dim; errors name what is allowed."""

from __future__ import annotations

import torch

from mmgen.attention.impls import AttentionImpl, FlashAttentionImpl, SDPAImpl
from mmgen.errors import ValidationError
from mmgen.kernels.contract import KERNEL_DTYPES
from mmgen.kernels.fa_providers import GPU_PROVIDERS, INSTALL_HINTS, installed_gpu_providers, probe_provider

BACKEND_NAMES = ("auto", "flash", "sdpa", *(f"flash:{name}" for name in (*GPU_PROVIDERS, "reference")))
MAX_FLASH_HEAD_DIM = 256


def select_attention(
    name: str, *, device: torch.device | str, dtype: torch.dtype, head_dim: int
) -> AttentionImpl:
    """The attention impl for a backend name; impl.provider reports the kernel that will run.

    auto: on CUDA with bf16/fp16 and head_dim <= 256, the first installed FlashAttention provider
    (FA3, FA4, FA2), else SDPA; on CPU, SDPA (the reference kernel is a slow per-row loop).
    flash: on CUDA the first installed provider (the reference when none is); on CPU the reference.
    flash:<provider>: exactly that provider, or a ValidationError saying what to install.
    On CUDA, flash and flash:fa* need bf16/fp16 and head_dim <= 256: otherwise a ValidationError,
    never a silent switch to another kernel (flash:reference takes any dtype).
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValidationError(f"unknown attention backend {name!r}; allowed: {', '.join(BACKEND_NAMES)}")
    on_cuda = device.type == "cuda"
    if name == "sdpa":
        return SDPAImpl()
    if name == "auto":
        kernels_fit = on_cuda and dtype in KERNEL_DTYPES and head_dim <= MAX_FLASH_HEAD_DIM
        installed = installed_gpu_providers() if kernels_fit else ()
        return FlashAttentionImpl(installed[0]) if installed else SDPAImpl()
    if name == "flash" and not on_cuda:
        return FlashAttentionImpl("reference")
    provider = name.partition(":")[2] or "auto"
    if provider == "reference":
        return FlashAttentionImpl("reference")
    _check_kernel_inputs(name, on_cuda=on_cuda, dtype=dtype, head_dim=head_dim)
    if provider == "auto":
        installed = installed_gpu_providers()
        return FlashAttentionImpl(installed[0] if installed else "reference")
    if probe_provider(provider) is None:
        raise ValidationError(
            f"attention backend {name!r}: {provider} is not installed; {INSTALL_HINTS[provider]}"
        )
    return FlashAttentionImpl(provider)


def _check_kernel_inputs(name: str, *, on_cuda: bool, dtype: torch.dtype, head_dim: int) -> None:
    if not on_cuda:
        raise ValidationError(f"attention backend {name!r} needs a CUDA device; on CPU use 'sdpa' or 'flash'")
    if dtype not in KERNEL_DTYPES:
        raise ValidationError(
            f"attention backend {name!r} needs bfloat16 or float16, got {dtype}; use 'sdpa' or 'flash:reference'"
        )
    if head_dim > MAX_FLASH_HEAD_DIM:
        raise ValidationError(
            f"attention backend {name!r} supports head_dim <= {MAX_FLASH_HEAD_DIM}, got {head_dim}; use 'sdpa'"
        )
