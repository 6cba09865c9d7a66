"""The Qwen-Image-2.1 transformer: single-stream blocks over one block-causal joint sequence.

Parameter names are diffusers' QwenImage21Transformer2DModel's, so a diffusers-format directory loads
as it is (mmgen.loading.qwen_image21). Dtypes follow diffusers: norms, modulation and residuals in the
model's dtype; the zero-centred text norm, the q/k RMSNorm variance and the rotation in float32.

Shapes: latents [B, Ni, in_channels] hold each sample's condition images' latent tokens then its
target's (diffusers' packing: Ni = the grids' tokens, the target's N last); text [B, L, context_in_dim]
holds each sample's text-encoder states from column 0 (L_b valid, image slots included: their states
are replaced by the condition images' latent tokens). The joint sequence, its RoPE positions and the
block-causal metadata come from a BlockCausalLayout built once per generation
(mmgen.models.qwen_image21_layout). The output is the target's prediction [B, N, out_channels].

The cached prefix (`causal_condition`): text and condition tokens are modulated at t = 0, so their
keys and values are the same at every step. A call given an empty PrefixCache (the request's state)
is the prefill: it runs the whole joint sequence and keeps its per-layer K/V there; later calls with
the filled cache compute only the target tokens (queries [B * N], keys prefix + target).

Ulysses (`parallel=`): each rank runs the per-token work on its share of the packed rows and attends
every row of its H / u heads after an all-to-all (mmgen.parallel.packed_rows), so the block-causal
metadata is the one a single process builds, unchanged, on every rank; its PrefixCache holds its heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.segments import SegmentMetadata, segment_attention
from mmgen.errors import ValidationError
from mmgen.layers.fused_activations import silu_mul
from mmgen.layers.fused_norms import (
    add_residual,
    head_rms_norm_rope,
    kernel_applies,
    layer_norm_modulate,
    residual_layer_norm,
)
from mmgen.models.call import DiTCall
from mmgen.models.qwen_image import ROPE_THETA, TIMESTEP_CHANNELS, TIMESTEP_SCALE, _check_call_settings
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from mmgen.models.qwen_image_blocks import RMSNorm, _axis_angles, _real_tables, _rotate
from mmgen.models.settings import ExecutionSettings
from mmgen.parallel.collective import Collective, run_now
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.packed_rows import PackedUlysses

ROW_KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class QwenImage21Config:
    """Architecture of a Qwen-Image-2.1 transformer; field names and defaults are diffusers' (7.12 B)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(d) for d in self.axes_dims_rope))
        for name in (
            "in_channels",
            "out_channels",
            "num_layers",
            "attention_head_dim",
            "num_attention_heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValidationError(f"QwenImage21Config.{name} must be a positive int, got {value!r}")
        if self.patch_size != 1:
            raise ValidationError(f"QwenImage21Config.patch_size={self.patch_size}: Qwen-Image-2.1 has 1")
        axes = self.axes_dims_rope
        if len(axes) != 3 or any(d < 2 or d % 2 for d in axes) or sum(axes) != self.attention_head_dim:
            raise ValidationError(
                f"QwenImage21Config.axes_dims_rope={axes}: expected 3 even dims summing to "
                f"attention_head_dim={self.attention_head_dim}"
            )

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @staticmethod
    def from_diffusers(config: Mapping[str, Any]) -> QwenImage21Config:
        """From a diffusers config.json dict; "_"-prefixed keys are skipped, any other unknown key raises."""
        known = {field.name for field in fields(QwenImage21Config)}
        unknown = sorted(k for k in config if k not in known and k[:1] != "_")
        if unknown:
            raise ValidationError(f"Qwen-Image-2.1 config has unknown keys {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in config.items() if k in known}
        if values.get("out_channels") is None:
            values["out_channels"] = values.get("in_channels", QwenImage21Config.in_channels)
        return QwenImage21Config(**values)


class PrefixCache:
    """One request's per-layer keys and values of its packed joint rows [T, H, D] (post-norm, post-RoPE).

    Request state, made empty per request (by the caller, like the LLM side's KV pool, never on the
    model): the first forward that gets it empty is the prefill and fills it; every later forward
    with it is a cached step. Contiguous, not paged: every sample's prefix length is fixed at the
    prefill and nothing is appended or evicted afterwards, so one buffer per layer in the prefill's
    own packed layout is the whole cache: the prefill keeps its K/V tensors (no copy), and sample
    b's keys stay contiguous ([prefix_b, target_b] at its sample start), which is what a varlen
    kernel reads with one (start, seqused_k) per sample; a page table would add an indirection and
    buy nothing. The target rows are scratch: each cached step writes its target K/V there before
    attending (the prefix rows are never written after the prefill). Cost: (prefix + N) tokens per
    layer, e.g. 32 x 4296 x 4096 x 2 x 2 bytes = 2.3 GB in bf16 for 1024x1024 text-to-image.
    Under Ulysses of degree u a rank's cache holds every row of its own H / u heads (the K/V its
    attention reads after the exchange; mmgen.parallel.packed_rows): 1 / u of that per rank, copied
    once at the prefill out of the exchange's buffer (where they are views beside q).
    """

    def __init__(self) -> None:
        self._keys: tuple[torch.Tensor, ...] = ()
        self._values: tuple[torch.Tensor, ...] = ()
        self._layout: BlockCausalLayout | None = None

    @property
    def filled(self) -> bool:
        return self._layout is not None

    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor], layout: BlockCausalLayout) -> None:
        """Keep the prefill's per-layer K/V (once: a filled cache is never refilled)."""
        if self.filled:
            raise ValidationError("this PrefixCache is filled already (one per request and branch)")
        self._keys, self._values, self._layout = tuple(keys), tuple(values), layout

    def take(self, other: PrefixCache) -> None:
        """Copy other's keys and values into this cache's own tensors (both filled, of the same shapes
        and layout values): a CUDA graph kept from an earlier request reads this cache's tensors
        (mmgen.models.step_graph.KeptGraph), so a later request's prefill is copied here."""
        if not (self.filled and other.filled) or len(self._keys) != len(other._keys):
            raise ValidationError("PrefixCache.take: both caches must be filled, with as many layers")
        for mine, theirs in zip((*self._keys, *self._values), (*other._keys, *other._values), strict=True):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValidationError(
                    f"PrefixCache.take: {tuple(theirs.shape)} {theirs.dtype} into {tuple(mine.shape)} {mine.dtype}"
                )
            mine.copy_(theirs)

    @property
    def heads(self) -> int:
        """Heads per row of the filled cache: all, or this rank's H / u under Ulysses."""
        return self._keys[0].shape[1]

    def layer(self, index: int, layout: BlockCausalLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer index's (keys, values) [T, H, D]; `layout` must be the one of the prefill."""
        if layout is not self._layout:
            raise ValidationError("a cached step takes the PrefixCache filled with this layout")
        return self._keys[index], self._values[index]


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is scale - 1, computed in float32 (diffusers' ZeroCenterRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rrms = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + self.eps)
        return (xf * rrms * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    """text [..., context_in_dim] -> [..., dim]: zero-centred RMSNorm, Linear, GELU(tanh), Linear."""

    def __init__(self, context_in_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(context_in_dim, eps)
        self.in_layer = nn.Linear(context_in_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepEmbedder(nn.Module):
    """Bias-free Linear, SiLU, Linear (diffusers' TimestepEmbedding with sample_proj_bias=False)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEmbedding(nn.Module):
    """timestep [R] in [0, 1] -> temb [R, dim]: cosines then sines of 1000 t, then the MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(TIMESTEP_CHANNELS, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = TIMESTEP_CHANNELS // 2
        exponent = torch.arange(half, dtype=torch.float32, device=timestep.device) / half
        freqs = torch.exp(-math.log(10000.0) * exponent)
        angles = (TIMESTEP_SCALE * timestep.to(dtype).float())[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(dtype)
        return self.timestep_embedder(features)


class SwiGLU(nn.Module):
    """x -> out(silu(gate_layer(x)) * proj(x)), bias-free (diffusers' QwenImage21SwiGLUFeedForward).

    kernel (the row kernels' setting): silu(gate) * up in one Triton pass on CUDA (rounded once:
    mmgen.layers.fused_activations); else, and on the CPU, torch's two ops, as diffusers.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, *, kernel: bool = False) -> torch.Tensor:
        return self.out(silu_mul(self.gate_layer(x), self.proj(x), kernel=kernel))


class Attention(nn.Module):
    """q/k/v projections, per-head RMSNorm, RoPE and segment attention; to_out as diffusers names it."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False)])
        self.norm_q = RMSNorm(head_dim, eps=eps)
        self.norm_k = RMSNorm(head_dim, eps=eps)

    def project(
        self, x: torch.Tensor, freqs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim], freqs complex [1, T, 1, D // 2] -> q, k, v [T, H, D] (q, k normed and rotated)."""
        q, k, v = (layer(x).unflatten(-1, (-1, self.head_dim)) for layer in (self.to_q, self.to_k, self.to_v))
        q = _rotate(self.norm_q(q).to(v.dtype)[None], freqs)[0]
        k = _rotate(self.norm_k(k).to(v.dtype)[None], freqs)[0]
        return q, k, v

    def project_fused(
        self,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        k_out: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """project() through the one-pass RMSNorm + RoPE kernel (float32 math, one rounding): q [T, H, D],
        and k written straight into rows `rows` of k_out [R, H * D] (the joint keys or the cache), v [T, H, D]."""
        q_rows = torch.arange(x.shape[0], device=x.device)
        q = head_rms_norm_rope(
            self.to_q(x)[None],
            self.norm_q.weight,
            self.norm_q.eps,
            out=torch.empty_like(x),
            out_rows=q_rows,
            rope=tables,
        )
        head_rms_norm_rope(
            self.to_k(x)[None], self.norm_k.weight, self.norm_k.eps, out=k_out, out_rows=rows, rope=tables
        )
        v = self.to_v(x).unflatten(-1, (-1, self.head_dim))
        return q.unflatten(-1, (-1, self.head_dim)), k_out.unflatten(-1, (-1, self.head_dim)), v


@dataclass(frozen=True, kw_only=True)
class QwenImage21Call(DiTCall):
    """Qwen-Image-2.1's record of one model call (mmgen.models.call), built once by its forward.

    metadata: the call's SegmentMetadata (the prefill's block-causal segments, or the cached step's
    one segment per sample); rope: complex [1, T, 1, D / 2] rotations, or the row kernels' (cos, sin)
    float32 [T, D] tables; temb [R, dim]; modulation: the per-token factors (1 + scale1, tanh(gate1),
    1 + scale2, tanh(gate2)), each [T, dim], or the row kernels' ModulationTables; fused: whether the
    blocks run the row kernels (then rope and modulation are in their form). ulysses: the call's rows
    over a Ulysses group (mmgen.parallel.packed_rows), or None in one process: then T above is this
    rank's rows, and the metadata is still the one of all rows (attention sees all rows of its heads).
    """

    metadata: SegmentMetadata
    modulation: Any
    fused: bool = False
    ulysses: PackedUlysses | None = None


class QwenImage21Block(nn.Module):
    """Single-stream block: modulated LayerNorm, attention, tanh-gated residual; the same for the SwiGLU MLP.

    The block holds no modulation weights: the model's one `modulation` serves every block, so its
    per-token factors are made once per call and read from the call record (QwenImage21Call).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, head_dim, eps)
        self.img_mlp = SwiGLU(dim, dim * mlp_ratio)

    def forward(
        self,
        x: torch.Tensor,
        call: QwenImage21Call,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        normed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, dim] -> (x [T, dim], k, v, normed): T joint rows (the prefill) or the target rows (a cached step).

        kv: a cached step's (cache_k, cache_v, target_rows) of this layer: this call's k/v are written
        into the cache at target_rows and the queries attend over the cache (the returned k, v are
        the cache's). The row kernels run when the call record says so (call.fused); then `normed`
        passes the attention input LayerNorm(x) * (1 + scale1) [T, dim] from block to block (the
        previous block's last row kernel made it; None: made here), and the op-by-op path returns None.
        """
        if call.fused:
            return self._forward_fused(x, call, kv, normed)
        scale1, gate1, scale2, gate2 = call.modulation
        normed = F.layer_norm(x, x.shape[-1:], eps=self.eps) * scale1
        q, k, v = self.attn.project(normed, call.rope)
        out, k, v = _attend(q, k, v, call, kv, keys_written=False)
        x = x + gate1 * self.attn.to_out[0](out.flatten(-2).type_as(q))
        normed = F.layer_norm(x, x.shape[-1:], eps=self.eps) * scale2
        x = x + gate2 * self.img_mlp(normed)
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x, k, v, None

    def _forward_fused(
        self,
        x: torch.Tensor,
        call: QwenImage21Call,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        normed: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """forward() through the one-pass row kernels (mmgen.layers.fused_norms): the modulation read from
        tables per token, q/k normed and rotated in one pass, k written straight into the cache rows,
        silu(gate) * up in one pass; the same formula, rounded once per kernel instead of per op (bf16
        roundings apart from diffusers). The last residual add also makes the next block's attention
        input: every block reads the same modulation (scale1), so it is one kernel, not two passes."""
        mod = call.modulation
        rows = mod.rows
        if normed is None:
            normed = layer_norm_modulate(
                x[None], eps=self.eps, shift=mod.shift, scale=mod.scale1, token_rows=rows
            )[0]
        # One process writes a cached step's keys straight into the cache rows; under Ulysses the
        # keys are this rank's rows of every head, so they are exchanged first and copied in after.
        direct = kv is not None and call.ulysses is None
        if direct:
            k_out, k_rows = kv[0].flatten(-2), kv[2]
        else:
            k_out, k_rows = torch.empty_like(x), torch.arange(x.shape[0], device=x.device)
        q, k, v = self.attn.project_fused(normed, call.rope, k_out, k_rows)
        out, k, v = _attend(q, k, v, call, kv, keys_written=direct)
        update = self.attn.to_out[0](out.flatten(-2).type_as(q))
        x, mlp_input = residual_layer_norm(
            x[None], update[None], mod.gate1, eps=self.eps, shift=mod.shift, scale=mod.scale2, token_rows=rows
        )
        update = self.img_mlp(mlp_input[0], kernel=True)[None]
        if x.dtype == torch.float16:
            # The clip comes between the residual and the next norm: those stay two passes.
            x = add_residual(x, update, mod.gate2, token_rows=rows)[0].clip(-65504, 65504)
            return x, k, v, None
        x, normed = residual_layer_norm(
            x, update, mod.gate2, eps=self.eps, shift=mod.shift, scale=mod.scale1, token_rows=rows
        )
        return x[0], k, v, normed[0]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: QwenImage21Call,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    keys_written: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segment attention of this call's q, k, v [T, H, D] -> (out [T, H, D], the keys and values read).

    Under Ulysses q, k, v go to all rows of this rank's heads first (the same segment metadata as one
    process: it indexes rows, not heads) and the output comes back to this rank's rows. A cached
    step's k/v (kv: cache_k, cache_v, target_rows) are written into the cache at target_rows first
    (keys_written: the row kernel wrote the keys there already) and attention reads the cache.
    """
    ulysses = call.ulysses
    if ulysses is not None:
        q, k, v = ulysses.to_heads(q, k, v)
    if kv is not None:
        cache_k, cache_v, rows = kv
        k = k if keys_written else cache_k.index_copy_(0, rows, k)  # written: k is the cache's view
        v = cache_v.index_copy_(0, rows, v)
    out = segment_attention(call.attention, q, k, v, call.metadata)
    return (out if ulysses is None else ulysses.to_rows(out)), k, v


@dataclass(frozen=True)
class ModulationTables:
    """The shared modulation as the row kernels read it: float32 tables [R, 1, dim] (scale1, tanh(gate1),
    scale2, tanh(gate2) of each modulation row, a zero shift: 2.1 has none) and each token's row, int64 [1, T]."""

    shift: torch.Tensor
    scale1: torch.Tensor
    gate1: torch.Tensor
    scale2: torch.Tensor
    gate2: torch.Tensor
    rows: torch.Tensor

    @staticmethod
    def build(modulation: torch.Tensor, rows: torch.Tensor) -> ModulationTables:
        """modulation [R, 4 * dim] in the model dtype (gates tanh'd there, as diffusers), rows int64 [T]."""
        scale1, gate1, scale2, gate2 = modulation.chunk(4, dim=-1)
        tables = [part[:, None].float() for part in (scale1, gate1.tanh(), scale2, gate2.tanh())]
        return ModulationTables(torch.zeros_like(tables[0]), *tables, rows[None])


def modulation_factors(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, 4 * dim] modulation rows (scale1, gate1, scale2, gate2) -> (1 + scale1, tanh(gate1), 1 + scale2,
    tanh(gate2)), each [T, dim]: the same values diffusers makes in every block, made once per call."""
    scale1, gate1, scale2, gate2 = rows.chunk(4, dim=-1)
    return 1 + scale1, gate1.tanh(), 1 + scale2, gate2.tanh()


class FinalNorm(nn.Module):
    """LayerNorm without weights, * (1 + scale); scale = Linear(SiLU(temb)) (no shift in 2.1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [T, dim], temb [R, dim], rows int64 [T]: which temb row each token reads."""
        scale = self.linear(F.silu(temb).to(x.dtype))[rows]
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale)


class QwenImage21Transformer(nn.Module):
    """Qwen-Image-2.1's transformer; state-dict keys are those of diffusers' QwenImage21Transformer2DModel."""

    def __init__(self, config: QwenImage21Config) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.time_text_embed = TimestepEmbedding(dim)
        self.txt_in = TextProjection(config.context_in_dim, dim, config.eps)
        self.img_in = nn.Linear(config.in_channels, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            QwenImage21Block(
                dim, config.num_attention_heads, config.attention_head_dim, config.mlp_ratio, config.eps
            )
            for _ in range(config.num_layers)
        )
        self.norm_out = FinalNorm(dim, config.eps)
        self.proj_out = nn.Linear(dim, config.out_channels, bias=False)
        self.row_kernels = "auto"

    def set_row_kernels(self, mode: str) -> QwenImage21Transformer:
        """The blocks' one-pass row kernels: "auto" (on CUDA), "on" (also on CPU, as their torch
        references: a test of the fused formulas) or "off" (diffusers' op-by-op roundings); returns self.
        A model setting chosen once (as Qwen-Image's set_fused_kernels), never changed for one call."""
        if mode not in ROW_KERNEL_MODES:
            raise ValidationError(f"row kernels {mode!r}: allowed {', '.join(ROW_KERNEL_MODES)}")
        self.row_kernels = mode
        return self

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """positions int64 [T, 3] -> complex64 [1, T, 1, head_dim // 2] (diffusers' float32 angles, polar)."""
        angles = torch.cat(
            [
                _axis_angles(positions[:, axis], dim, ROPE_THETA)
                for axis, dim in enumerate(self.config.axes_dims_rope)
            ],
            dim=-1,
        )
        return torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor | None,
        *,
        attention: AttentionImpl,
        text_lens: torch.Tensor | Sequence[int] | None = None,
        metadata: BlockCausalLayout | None = None,
        parallel: ParallelLayout | None = None,
        settings: ExecutionSettings | None = None,
        grids: Sequence[tuple[int, int, int]] | None = None,
        slot_masks: torch.Tensor | None = None,
        cache: PrefixCache | None = None,
        collective: Collective = run_now,
    ) -> torch.Tensor:
        """latents [B, Ni, in_channels] (a cached step may pass only the target's [B, N, ...]), timestep [B]
        in [0, 1], text [B, L, context_in_dim] (None on a cached step) -> prediction [B, N, out_channels].

        The DiT call contract (mmgen.models.call). metadata: the BlockCausalLayout of these prompts and
        grids, built once per generation by the caller; else built here from text_lens (None: all L),
        `grids` (condition images then target) and `slot_masks` (give one of metadata and text_lens).
        parallel: None, or a layout whose SP group runs Ulysses (its degree dividing the heads; no ring):
        each rank computes its shard of this call's packed rows and attends all rows of its heads
        (mmgen.parallel.packed_rows), so `metadata` is the same on every rank; every rank returns the
        whole prediction. A cache then holds this rank's heads. settings: only a block stream applies.
        cache: the request's PrefixCache: empty -> this call is the prefill and fills it; filled -> a
        cached step (only the target tokens are computed; needs causal_condition). collective: how the
        Ulysses exchanges run (mmgen.parallel.collective: now, or as the seams of a graph capture).
        """
        sharded = parallel is not None and parallel.sp_degree > 1
        settings = _check_call_settings(settings, None)
        layout = self._layout(latents, text, text_lens, metadata, grids, slot_masks)
        cached = cache is not None and cache.filled
        self._check(latents, timestep, text, layout, cache, parallel if sharded else None)
        batch, target = layout.batch, layout.target_tokens
        temb = self._timestep_embedding(timestep)
        modulation = self.modulation(temb)
        target_samples = torch.arange(batch, device=latents.device).repeat_interleave(target)
        if not cached:
            x = self._joint_tokens(latents, text, layout)
            causal = self.config.causal_condition
            rows = layout.modulation_rows if causal else layout.sample_rows
            positions, segments = layout.positions, layout.prefill
        else:
            x = self.img_in(latents[:, -target:].to(self.dtype)).reshape(batch * target, -1)
            rows, positions, segments = target_samples, layout.positions[layout.target_rows], layout.cached
        ulysses = None
        if sharded:
            # Per-token inputs follow the rows; the segment metadata stays whole (the module docstring
            # of mmgen.parallel.packed_rows: each rank attends every row of its own heads).
            ulysses = PackedUlysses.plan(x.shape[0], self.config.num_attention_heads, parallel, collective)
            x, rows, positions = (ulysses.split(t) for t in (x, rows, positions))
        fused = self.row_kernels == "on" or (self.row_kernels == "auto" and kernel_applies(x, True))
        freqs = self.rope(positions)
        call = QwenImage21Call(
            attention=attention,
            metadata=segments,
            rope=_real_tables(freqs) if fused else freqs,
            temb=temb,
            settings=settings,
            modulation=ModulationTables.build(modulation, rows)
            if fused
            else modulation_factors(modulation[rows]),
            fused=fused,
            ulysses=ulysses,
        )
        keys, values, normed = [], [], None
        for index, block in enumerate(settings.blocks(self.transformer_blocks)):
            kv = (*cache.layer(index, layout), layout.target_rows) if cached else None
            # normed: the next block's attention input, made by this block's last row kernel (the last
            # block's goes unused: one [T, dim] write, against a separate norm pass in every other block).
            x, k, v, normed = block(x, call, kv, normed)
            if cache is not None and not cached:
                # Under Ulysses k, v are views of the layer's exchange buffer (q too): copy them out,
                # so the cache holds only them. One process: already contiguous, no copy.
                keys.append(k.contiguous())
                values.append(v.contiguous())
        if cache is not None and not cached:
            cache.fill(keys, values, layout)
        if ulysses is not None:
            x = ulysses.gather(x)
        if not cached:
            x = x[layout.target_rows]
        return self.proj_out(self.norm_out(x, temb, target_samples)).view(batch, target, -1)

    def _layout(
        self,
        latents: torch.Tensor,
        text: torch.Tensor | None,
        text_lens: torch.Tensor | Sequence[int] | None,
        metadata: BlockCausalLayout | None,
        grids: Sequence[tuple[int, int, int]] | None,
        slot_masks: torch.Tensor | None,
    ) -> BlockCausalLayout:
        """metadata as given (then no text_lens, grids or slot_masks), else built from them."""
        if metadata is not None:
            if text_lens is not None or grids is not None or slot_masks is not None:
                raise ValidationError(
                    "metadata: give the BlockCausalLayout or text_lens/grids/slot_masks, not both"
                )
            return metadata
        if grids is None or text is None:
            raise ValidationError("metadata: without a BlockCausalLayout the call needs text and grids")
        lens = [text.shape[1]] * latents.shape[0] if text_lens is None else [int(n) for n in text_lens]
        return BlockCausalLayout.build(
            lens, grids, text_width=text.shape[1], slot_masks=slot_masks, device=latents.device
        )

    def _timestep_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """temb [B + 1, dim] with causal_condition (the last row t = 0), else [B, dim]."""
        timestep = timestep.to(self.dtype)
        if self.config.causal_condition:
            timestep = torch.cat([timestep, timestep.new_zeros(1)])
        return self.time_text_embed(timestep, self.dtype)

    def _joint_tokens(
        self, latents: torch.Tensor, text: torch.Tensor, layout: BlockCausalLayout
    ) -> torch.Tensor:
        """The packed joint rows [T, dim]: projected text tokens and latent tokens at their layout rows."""
        text = self.txt_in(text.to(self.dtype)).flatten(0, 1)
        image = self.img_in(latents.to(self.dtype)).flatten(0, 1)
        joint = image.new_empty(layout.total_tokens, image.shape[-1])
        joint.index_copy_(0, layout.text_rows, text.index_select(0, layout.text_source))
        return joint.index_copy_(0, layout.image_rows, image)

    def _check(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor | None,
        layout: BlockCausalLayout,
        cache: PrefixCache | None,
        parallel: ParallelLayout | None,
    ) -> None:
        config = self.config
        cached = cache is not None and cache.filled
        tokens = layout.target_tokens if cached else layout.latent_tokens
        if latents.dim() != 3 or latents.shape[0] != layout.batch or latents.shape[-1] != config.in_channels:
            raise ValidationError(
                f"latents {tuple(latents.shape)}: expected [B={layout.batch}, Ni, in_channels={config.in_channels}]"
            )
        if latents.shape[1] not in (tokens, layout.latent_tokens):
            raise ValidationError(f"latents have {latents.shape[1]} tokens; the layout has {tokens}")
        if tuple(timestep.shape) != (layout.batch,):
            raise ValidationError(f"timestep {tuple(timestep.shape)}: expected [B={layout.batch}]")
        if not cached:
            expected = (layout.batch, layout.text_width, config.context_in_dim)
            if text is None or tuple(text.shape) != expected:
                raise ValidationError(
                    f"text {None if text is None else tuple(text.shape)}: expected {expected}"
                )
        if cache is not None and not config.causal_condition:
            raise ValidationError(
                "the prefix cache needs causal_condition=True (text and condition tokens modulated at t = 0)"
            )
        heads = config.num_attention_heads // (1 if parallel is None else parallel.ulysses_degree)
        if cached and cache.heads != heads:
            raise ValidationError(
                f"this PrefixCache holds {cache.heads} heads per row, this call attends {heads}: a cached "
                "step runs under the parallel layout of its prefill"
            )
