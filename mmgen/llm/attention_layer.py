"""The per-layer attention parameters an LLM layer hands to its backend (window, softcap, scale, kind)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionLayer:
    """Static facts of one attention site; the backend reads them, never a global.

    sliding_window: keys a query may look back (the query itself included counts as window_left =
    sliding_window - 1 in flash-attn terms, as HF's Gemma-2 masks do); None = global attention.
    logit_softcap: 0 = none. is_cross_attention: keys/values are the encoder's, read through the
    encoder part of req_to_token; non-causal.
    """

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_softcap: float = 0.0
    is_cross_attention: bool = False
