"""Attention backends of the paged-KV runtime: the interface, and a factory by name."""

from __future__ import annotations

from mmgen.errors import ValidationError
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.memory import KVPool, ReqToTokenPool

BACKEND_NAMES = ("torch_native",)


def make_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool) -> AttentionBackend:
    """The backend called `name`, built on the given pools."""
    if name == "torch_native":
        from mmgen.llm.backends.torch_native import TorchNativeBackend

        return TorchNativeBackend(req_to_token_pool, kv_pool)
    raise ValidationError(
        f"attention backend {name!r} is not known; choose one of {', '.join(BACKEND_NAMES)}"
    )


__all__ = ["AttentionBackend", "BACKEND_NAMES", "make_backend"]
