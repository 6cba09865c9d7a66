"""The pieces of the Wan DiT: its attention layer, transformer block and condition embedder.

Parameter names follow diffusers' WanTransformer3DModel so diffusers-format checkpoints load as they
are. Dtype handling follows it too: norms, modulation, gated residuals and RoPE compute in float32,
the rest in the model's dtype; results are rounded to the model's dtype at the same points. The float32
steps are written so that eager mode makes one pass where the reference makes several (see
mmgen.layers.modulation), and so that `WanDiT.compile_blocks()` can fuse each run of them into one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata, DiTAttention
from mmgen.layers.embeddings import TextProjection, TimestepMLP, timestep_sinusoid
from mmgen.layers.mlp import GeluTanhFeedForward
from mmgen.layers.modulation import gated_residual, modulate_as, modulation_vectors
from mmgen.layers.norms import FP32LayerNorm
from mmgen.layers.rotary import apply_rope


@torch.compiler.disable
def _attend(
    attention: AttentionImpl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """attention(q, k, v, meta), kept out of compiled graphs.

    FA4's CuTe DSL kernels cannot be traced, and traced SDPA would let inductor pick the SDPA backend
    again; so under compile_blocks() the kernel an impl reports is still the kernel that runs.
    """
    return attention(q, k, v, meta)


class WanAttention(nn.Module):
    """Multi-head attention with RMSNorm on q and k across all heads (Wan's qk_norm) and optional RoPE."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # index 0, as the checkpoints name it
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionImpl,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim] attends to context [B, L, dim] (x itself for self-attention) -> [B, S, dim].

        rope: (cos_full, sin_signed) float32 [1, S, 1, head_dim] from rope_3d_tables, or None.
        """
        q = self.norm_q(self.to_q(x)).unflatten(2, (self.heads, -1))
        k = self.norm_k(self.to_k(context)).unflatten(2, (self.heads, -1))
        v = self.to_v(context).unflatten(2, (self.heads, -1))
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        out = _attend(attention, q, k, v, meta).flatten(2).type_as(q)
        return self.to_out[0](out)


class WanBlock(nn.Module):
    """Self-attention (RoPE), cross-attention to the text, FFN; AdaLN modulation from the timestep."""

    def __init__(self, dim: int, ffn_dim: int, heads: int, *, cross_attn_norm: bool, eps: float) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, eps)
        self.attn2 = WanAttention(dim, heads, eps)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.ffn = GeluTanhFeedForward(dim, ffn_dim)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        text: torch.Tensor,
        time_projection: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: DiTAttention,
        attention: AttentionImpl,
    ) -> torch.Tensor:
        """x [B, S, dim], text [B, L, dim], time_projection [B, 6, dim] -> [B, S, dim]."""
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = modulation_vectors(
            self.scale_shift_table, time_projection, 6
        )
        h = modulate_as(self.norm1(x.float()), shift, scale, x.dtype)
        x = gated_residual(x, self.attn1(h, h, meta.self_attn, attention, rope), gate)
        h = self.norm2(x.float()).to(x.dtype)
        x = x + self.attn2(h, text, meta.cross_attn, attention)  # bf16 add, as the reference does
        h = modulate_as(self.norm3(x.float()), ffn_shift, ffn_scale, x.dtype)
        return gated_residual(x, self.ffn(h), ffn_gate)


class WanConditionEmbedder(nn.Module):
    """Timestep -> (embedding [B, dim], 6-way projection [B, 6 * dim]); text [B, L, text_dim] -> [B, L, dim]."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = TimestepMLP(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TextProjection(text_dim, dim)

    def forward(
        self, timestep: torch.Tensor, text: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """timestep [B] float, text [B, L, text_dim] -> temb [B, dim], projection [B, 6 * dim], text [B, L, dim]."""
        features = timestep_sinusoid(timestep, self.freq_dim)
        # The time MLP may be kept in float32 while the rest runs in bf16; its output joins the text dtype.
        features = features.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(features).type_as(text)
        return temb, self.time_proj(F.silu(temb)), self.text_embedder(text)
