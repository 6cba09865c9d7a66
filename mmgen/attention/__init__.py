"""Diffusion attention: explicit metadata, FlashAttention / SDPA impls, and backend selection."""

from mmgen.attention.impls import AttentionImpl, FlashAttentionImpl, SDPAImpl
from mmgen.attention.metadata import AttentionMetadata, DiTAttention
from mmgen.attention.selection import BACKEND_NAMES, select_attention

__all__ = (
    "BACKEND_NAMES",
    "AttentionImpl",
    "AttentionMetadata",
    "DiTAttention",
    "FlashAttentionImpl",
    "SDPAImpl",
    "select_attention",
)
