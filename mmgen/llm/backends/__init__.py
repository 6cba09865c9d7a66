"""Attention backends of the paged-KV runtime: the interface, and a factory by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmgen.errors import ValidationError
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.backends.flash_attention import FlashAttentionBackend
from mmgen.llm.backends.flashinfer import FlashInferBackend
from mmgen.llm.backends.torch_native import TorchNativeBackend
from mmgen.llm.memory import KVPool, ReqToTokenPool

BACKEND_NAMES = ("torch_native", "flash_attention", "flashinfer")


def make_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    kv_pool: KVPool,
    layers: Sequence[AttentionLayer] = (),
    **options: Any,
) -> AttentionBackend:
    """The backend called `name`, built on the given pools.

    layers: the model's attention sites (model.decoder_attention_layers()); flash_attention computes
    its scheduler metadata per distinct site from them, flashinfer plans its wrapper sets from them.
    options: backend keywords (provider=, use_tensor_cores=, ...).
    """
    if name == "torch_native":
        return TorchNativeBackend(req_to_token_pool, kv_pool)
    if name == "flash_attention":
        return FlashAttentionBackend(req_to_token_pool, kv_pool, layers, **options)
    if name == "flashinfer":
        return FlashInferBackend(req_to_token_pool, kv_pool, layers, **options)
    raise ValidationError(
        f"attention backend {name!r} is not known; choose one of {', '.join(BACKEND_NAMES)}"
    )


__all__ = ["AttentionBackend", "BACKEND_NAMES", "make_backend"]
