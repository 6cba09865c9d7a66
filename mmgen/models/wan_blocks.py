"""The pieces of the Wan DiT: its attention layer, transformer block and condition embedder.

Parameter names follow diffusers' WanTransformer3DModel so diffusers-format checkpoints load as they
are. Dtype handling follows it too: norms, modulation, gated residuals and RoPE compute in float32,
the rest in the model's dtype; results are rounded to the model's dtype at the same points.

Fast paths (each a switch, each within bf16 rounding of the plain path):
- the row passes between the matmuls (residual + LayerNorm + modulation; q/k RMSNorm + RoPE; the
  FFN's gated residual) run as one Triton kernel each on CUDA (mmgen.layers.fused_norms;
  `fused_kernels`, on by default, WanDiT.set_fused_kernels); elsewhere they run as torch ops
  written to make one pass where the reference makes several;
- `fuse_projections()` puts q/k/v (self-attention) and k/v (cross-attention) into one matrix each,
  so one wide GEMM replaces three or two narrow ones (off until called; WanDiT.compile_blocks calls it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.attention.fp8 import Fp8Attention
from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata, DiTAttention
from mmgen.errors import ValidationError
from mmgen.layers.compile_guard import not_compiled
from mmgen.layers.embeddings import TextProjection, TimestepMLP, timestep_sinusoid
from mmgen.layers.fp8_linear import Fp8Activation, Fp8WeightCache, dense, fp8_linear, linear_fp8
from mmgen.layers.fused_norms import add_residual, layer_norm_modulate, residual_layer_norm, rms_norm_rope
from mmgen.layers.low_rank import add_low_rank_terms, concat_columns, low_rank_linear
from mmgen.layers.mlp import GeluTanhFeedForward
from mmgen.layers.modulation import modulation_vectors, scale_shift_table
from mmgen.layers.norms import FP32LayerNorm
from mmgen.models.call import DiTCall
from mmgen.models.settings import ExecutionSettings
from mmgen.parallel.sequence import SequenceShard

SELF_QKV = ("to_q", "to_k", "to_v")  # self-attention: q, k and v all project the same tokens
CROSS_KV = ("to_k", "to_v")  # cross-attention: k and v project the text, q the video tokens
# FP8 layer kinds (mmgen.layers.fp8_linear.FP8_LAYER_KINDS) -> (sub-module, its layers that run in FP8).
FP8_KIND_LAYERS = {
    "self_qkv": ("attn1", SELF_QKV),
    "cross_q": ("attn2", ("to_q",)),
    "cross_kv": ("attn2", CROSS_KV),
    "attn_out": ("attn", ("to_out",)),  # both attentions
    "ffn_in": ("ffn", ("in",)),
    "ffn_out": ("ffn", ("out",)),
}
NO_FP8: frozenset[str] = frozenset()


def fp8_linear_names(kinds: frozenset[str]) -> dict[str, frozenset[str]]:
    """FP8 layer kinds -> the layers of each sub-module ("attn1", "attn2", "ffn") that run in FP8."""
    chosen: dict[str, set[str]] = {"attn1": set(), "attn2": set(), "ffn": set()}
    for kind in kinds:
        owner, layers = FP8_KIND_LAYERS[kind]
        for name in ("attn1", "attn2") if owner == "attn" else (owner,):
            chosen[name].update(layers)
    return {name: frozenset(layers) for name, layers in chosen.items()}


@not_compiled  # torch.compiler.disable without importing torch._dynamo at import (mmgen.layers.compile_guard)
def _attend(
    attention: AttentionImpl,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """attention(q, k, v, meta), kept out of compiled graphs; `out` only for impls that write into one.

    FA4's CuTe DSL kernels cannot be traced, and traced SDPA would let inductor pick the SDPA backend
    again; so under compile_blocks() the kernel an impl reports is still the kernel that runs.
    """
    return attention(q, k, v, meta) if out is None else attention(q, k, v, meta, out=out)


class WanAttention(nn.Module):
    """Multi-head attention with RMSNorm on q and k across all heads (Wan's qk_norm) and optional RoPE.

    With `added_kv_proj_dim` (the cross-attention of image-conditioned models) it also projects
    image tokens to keys/values (add_k_proj, add_v_proj, norm_added_k on the keys); the queries
    attend to the text and to the image in two calls, whose outputs are summed before to_out.
    """

    def __init__(self, dim: int, heads: int, eps: float, added_kv_proj_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # index 0, as the checkpoints name it
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = nn.RMSNorm(dim, eps=eps)
        self.fused_kernels = True
        self.fused_projections: tuple[str, ...] = ()
        # The quantized weights of the projections a call runs in FP8 (its `fp8` argument: names as
        # SELF_QKV, plus "to_out"), cached across calls (mmgen.layers.fp8_linear).
        self.fp8_weights = Fp8WeightCache()
        # Set by fuse_projections(); non-persistent, so state-dict keys stay the checkpoint's.
        self.register_buffer("fused_weight", None, persistent=False)
        self.register_buffer("fused_bias", None, persistent=False)

    def fuse_projections(self, names: tuple[str, ...]) -> None:
        """Stack the named projections (SELF_QKV or CROSS_KV) into one matrix for one GEMM; values unchanged.

        The stacked weight [n * dim, dim] and bias [n * dim] become the storage of the projections'
        own parameters, which turn into row slices of it: no second copy of the weights exists, the
        state dict keeps its keys and values, and load_state_dict (copying in place) updates both
        views. Moving or casting the module (.to, .half) re-stacks automatically (see _apply); a
        load_state_dict(assign=True) replaces the parameters, so call this again after one. Like the
        rest of the model (out= ops), the stacked path is for inference: it reads the stack, not the
        parameters, so it would not carry gradients to them.
        """
        if names not in (SELF_QKV, CROSS_KV):
            raise ValidationError(f"fuse_projections({names!r}): allowed {SELF_QKV!r} or {CROSS_KV!r}")
        layers = [getattr(self, name) for name in names]
        with torch.no_grad():
            weight = torch.cat([layer.weight.detach() for layer in layers])
            bias = torch.cat([layer.bias.detach() for layer in layers])
        rows = layers[0].out_features
        for index, layer in enumerate(layers):
            layer.weight.data = weight[index * rows : (index + 1) * rows]
            layer.bias.data = bias[index * rows : (index + 1) * rows]
        self.fused_weight, self.fused_bias = weight, bias
        self.fused_projections = names

    def _apply(self, fn, recurse=True):  # nn.Module's hook for .to(), .half(), ...
        super()._apply(fn, recurse)
        if self.fused_projections:
            # The conversion made separate tensors of the weight views and of the stack: share again.
            self.fuse_projections(self.fused_projections)
        return self

    def set_fused_kernels(self, enabled: bool) -> None:
        """The Triton row kernels on or off (model setup; see WanDiT.set_fused_kernels)."""
        self.fused_kernels = bool(enabled)

    def project(
        self,
        x: torch.Tensor | Fp8Activation,
        context: torch.Tensor | Fp8Activation,
        fp8: frozenset[str] = NO_FP8,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, S, dim] from x; k, v [B, L, dim] from context (slices of one GEMM's output when stacked).

        The layers named in fp8 run in FP8; x may come quantized when every layer reading it is FP8.
        A stack runs as one GEMM when its layers are all FP8 (the stack quantizes per output channel
        exactly as its parts would) or all bf16. The stacked GEMM bypasses the layers' forward, so an
        unfused LoRA's terms are added to its columns (low_rank_linear; add_low_rank_terms in bf16
        from the dequantized input after an FP8 GEMM); with no LoRA it is plain F.linear.
        """
        fused = self.fused_projections
        if context is x and fused == SELF_QKV:
            layers = (self.to_q, self.to_k, self.to_v)
            if fp8.issuperset(SELF_QKV):
                weight = self.fp8_weights.get("stack", self.fused_weight)
                qkv = fp8_linear(x, weight, self.fused_bias, self.fused_weight.dtype)
                q, k, v = add_low_rank_terms(dense(x, qkv.dtype), qkv, layers).chunk(3, dim=-1)
                return q, k, v
            if fp8.isdisjoint(SELF_QKV):
                q, k, v = low_rank_linear(x, self.fused_weight, self.fused_bias, layers).chunk(3, dim=-1)
                return q, k, v
        q = self._linear("to_q", x, fp8)
        if fused == CROSS_KV and fp8.isdisjoint(CROSS_KV):
            layers = (self.to_k, self.to_v)
            k, v = low_rank_linear(context, self.fused_weight, self.fused_bias, layers).chunk(2, dim=-1)
            return q, k, v
        return q, self._linear("to_k", context, fp8), self._linear("to_v", context, fp8)

    def spare_columns(self, *, self_attention: bool, fp8: frozenset[str] = NO_FP8) -> int:
        """Spare columns the "concat" LoRA kernel wants after the input x (0: none; mmgen.layers.low_rank):
        self-attention's stacked q/k/v group (never unstacked: k and v read x too), cross-attention's q."""
        if self_attention:
            if self.fused_projections != SELF_QKV or not fp8.isdisjoint(SELF_QKV):
                return 0
            return concat_columns((self.to_q, self.to_k, self.to_v), self.fused_weight)
        return 0 if "to_q" in fp8 else concat_columns((self.to_q,), self.to_q.weight)

    def output_spare_columns(self, attention: AttentionImpl, fp8: frozenset[str] = NO_FP8) -> int:
        """Spare columns the "concat" LoRA kernel of to_out wants after the attention output (0: none).

        Nonzero only where the impl writes its result into a given buffer (`writes_out`, FA3): the
        output then lands in the first columns of padded rows at no extra pass; for other impls a
        padded copy would cost what the other kernel costs, so they keep it.
        """
        if "to_out" in fp8 or not getattr(attention, "writes_out", False):
            return 0
        return concat_columns((self.to_out[0],), self.to_out[0].weight)

    def attend(
        self,
        attention: AttentionImpl,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spare_columns: int = 0,
    ) -> torch.Tensor:
        """q [B, S, H, D], k/v [B, L, H, D] -> the attention output [B, S, H * D (+ spare_columns)].

        With spare_columns (output_spare_columns) the impl writes into the first H * D columns of a
        padded buffer, whose spare columns to_out's "concat" kernel fills; the values are the same.
        """
        if not spare_columns:
            return _attend(attention, q, k, v, meta).flatten(2).type_as(q)
        width = q.shape[2] * v.shape[-1]
        buffer = q.new_empty(*q.shape[:2], width + spare_columns)
        _attend(attention, q, k, v, meta, out=buffer[..., :width].unflatten(2, (q.shape[2], -1)))
        return buffer

    def _linear(self, name: str, x: torch.Tensor | Fp8Activation, fp8: frozenset[str]) -> torch.Tensor:
        """Projection `name` (SELF_QKV or "to_out") of x, in FP8 when named in fp8."""
        layer = self.to_out[0] if name == "to_out" else getattr(self, name)
        if name in fp8:
            return linear_fp8(layer, x, self.fp8_weights, name)
        return layer(dense(x, layer.weight.dtype))

    def output(self, out: torch.Tensor, fp8: frozenset[str] = NO_FP8) -> torch.Tensor:
        """to_out of the attention output [B, S', dim] (any token range) -> [B, S', dim]; FP8 when named."""
        return self._linear("to_out", out, fp8) if fp8 else self.to_out[0](out)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionImpl,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        image: torch.Tensor | None = None,
        image_meta: AttentionMetadata | None = None,
        fp8: frozenset[str] = NO_FP8,
    ) -> torch.Tensor:
        """x [B, S, dim] attends to context [B, L, dim] (x itself for self-attention) -> [B, S, dim].

        rope: (cos_full, sin_signed) float32 [1, S, 1, head_dim] from rope_3d_tables, or None.
        image: embedded image tokens [B, N, dim] (image-conditioned cross-attention) with image_meta.
        fp8: the projections that run in FP8 (SELF_QKV names, "to_out"); empty = none.
        """
        q, k, v = self.qkv(x, context, rope, fp8)
        out = self.attend(attention, q, k, v, meta, self.output_spare_columns(attention, fp8))
        if image is not None:
            image_out = self._attend_image(q, image, image_meta, attention)
            if out.shape[-1] == image_out.shape[-1]:
                out = out + image_out
            else:  # padded rows: the sum goes into their first columns (the same values)
                out[..., : image_out.shape[-1]] += image_out
        return self.output(out, fp8)

    def qkv(
        self,
        x: torch.Tensor | Fp8Activation,
        context: torch.Tensor | Fp8Activation,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        fp8: frozenset[str] = NO_FP8,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, S, H, D] from x, k and v [B, L, H, D] from context: projected, q and k RMS-normed (+ RoPE).

        Every op is per token, so x (with context x and rope sliced alike) may be a token range of
        the sequence: WanBlock's chunked path fills whole q, k, v range by range. x may come
        quantized (Fp8Activation) when its projections run in FP8.
        """
        q, k, v = self.project(x, context, fp8)
        q = rms_norm_rope(
            q, self.norm_q.weight, self.norm_q.eps, heads=self.heads, rope=rope, kernel=self.fused_kernels
        )
        k = rms_norm_rope(
            k, self.norm_k.weight, self.norm_k.eps, heads=self.heads, rope=rope, kernel=self.fused_kernels
        )
        return q, k, v.unflatten(2, (self.heads, -1))

    def _attend_image(
        self, q: torch.Tensor, image: torch.Tensor, meta: AttentionMetadata | None, attention: AttentionImpl
    ) -> torch.Tensor:
        """q [B, S, H, D] attends to image tokens [B, N, dim] through the added projections -> [B, S, dim]."""
        k = rms_norm_rope(
            self.add_k_proj(image),
            self.norm_added_k.weight,
            self.norm_added_k.eps,
            heads=self.heads,
            rope=None,
            kernel=self.fused_kernels,
        )
        v = self.add_v_proj(image).unflatten(2, (self.heads, -1))
        meta = AttentionMetadata() if meta is None else meta
        return _attend(attention, q, k, v, meta).flatten(2).type_as(q)


@dataclass(frozen=True, kw_only=True)
class WanCall(DiTCall):
    """Wan's record of one model call (mmgen.models.call), built once by WanDiT.prepare_call.

    Blocks read text (the embedded text [B, L, dim]: the cross-attention keys), time_projection
    [N, 6, dim], token_rows (int32 [B, S]: each token's row of time_projection, or None: row b for
    sample b), image (embedded image tokens [B, N', dim] or None) and the base fields: rope (cos, sin)
    float32 [1, S, 1, head_dim], metadata, attention, settings. The head and VACE read x (the patch
    tokens [B, S, dim] the blocks start from), temb [N, dim], grid (F', H', W') and shard. Under
    sequence parallelism x, rope, metadata.self_attn and attention are this rank's (shard says how).
    """

    metadata: DiTAttention
    rope: tuple[torch.Tensor, torch.Tensor]
    x: torch.Tensor
    text: torch.Tensor
    time_projection: torch.Tensor
    grid: tuple[int, int, int]
    image: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    shard: SequenceShard | None = None


class WanBlock(nn.Module):
    """Self-attention (RoPE), cross-attention to the text, FFN; AdaLN modulation from the timestep."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        heads: int,
        *,
        cross_attn_norm: bool,
        eps: float,
        added_kv_proj_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, eps)
        self.attn2 = WanAttention(dim, heads, eps, added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.ffn = GeluTanhFeedForward(dim, ffn_dim)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = scale_shift_table(6, dim)
        self.cross_attn_norm = cross_attn_norm
        self.fused_kernels = True

    def set_fused_kernels(self, enabled: bool) -> None:
        """The Triton row kernels on or off in this block (model setup; see WanDiT.set_fused_kernels)."""
        self.fused_kernels = bool(enabled)
        self.attn1.set_fused_kernels(enabled)
        self.attn2.set_fused_kernels(enabled)

    def release_fp8_weights(self) -> None:
        """Drop the cached FP8 weight copies of this block's layers (re-made by the next FP8 call)."""
        for cache in (self.attn1.fp8_weights, self.attn2.fp8_weights, self.ffn.fp8_weights):
            cache.clear()

    def fuse_projections(self) -> None:
        """Self-attention q/k/v and cross-attention k/v as one GEMM each (WanAttention.fuse_projections)."""
        self.attn1.fuse_projections(SELF_QKV)
        self.attn2.fuse_projections(CROSS_KV)

    def forward(self, x: torch.Tensor, call: WanCall) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim], reading the call's text [B, L, dim], time_projection
        [B, 6, dim], RoPE tables, metadata, impl, image tokens and settings (WanCall).

        With call.token_rows int32 [B, S] (one timestep per token, Wan2.2 TI2V), time_projection is
        [N, 6, dim], one row per distinct timestep, and token (b, s) is modulated by row
        token_rows[b, s] (mmgen.layers.modulation.distinct_timesteps; WanDiT.prepare_call builds both).
        call.image: embedded image tokens [B, N, dim] for image-conditioned cross-attention, or None.
        call.settings: this call's chunks and FP8 choices (mmgen.models.settings).
        """
        settings = call.settings
        fp8 = fp8_linear_names(settings.fp8_layers)
        chunk = settings.block_chunk
        modulation = self._modulation(call.time_projection)
        token_rows = call.token_rows
        if chunk is not None and x.shape[1] > chunk and call.metadata.cross_attn.cu_seqlens_q is None:
            return self._forward_chunked(x, modulation, call, fp8)
        shift, scale, *after = modulation
        h = layer_norm_modulate(
            x,
            eps=self.norm1.eps,
            shift=shift,
            scale=scale,
            kernel=self.fused_kernels,
            # With FP8 q/k/v, the norm emits its output quantized (fp8 + row scales).
            fp8="self_qkv" in settings.fp8_layers,
            token_rows=token_rows,
            # An unfused LoRA's "concat" kernel wants spare columns after h (0 without it, or in FP8).
            spare_columns=self.attn1.spare_columns(self_attention=True, fp8=fp8["attn1"]),
        )
        impl = self._self_attention(call.attention, settings)
        attended = self.attn1(h, h, call.metadata.self_attn, impl, call.rope, fp8=fp8["attn1"])
        return self._after_self_attention(x, attended, after, token_rows, call, fp8)

    @staticmethod
    def _self_attention(attention: AttentionImpl, settings: ExecutionSettings) -> AttentionImpl:
        """The impl the self-attention runs: `attention`, on e4m3 q/k/v with settings.fp8_attention."""
        return Fp8Attention(attention) if settings.fp8_attention else attention

    def _modulation(self, time_projection: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """shift, scale, gate, ffn_shift, ffn_scale, ffn_gate: float32 tables [N, 1, dim] (N rows of time_projection)."""
        return modulation_vectors(self.scale_shift_table, time_projection, 6)

    def _after_self_attention(
        self,
        x: torch.Tensor,
        attended: torch.Tensor,
        modulation: list[torch.Tensor],
        token_rows: torch.Tensor | None,
        call: WanCall,
        fp8: dict[str, frozenset[str]],
    ) -> torch.Tensor:
        """Gated residual of the self-attention output, cross-attention, FFN: x, attended [B, S, dim] -> [B, S, dim].

        Per token throughout (the cross-attention's queries are these tokens, its keys the whole
        text), so it runs alike on the whole sequence or on one token range of it (token_rows
        [B, S]: call.token_rows sliced alike).
        """
        settings = call.settings
        gate, ffn_shift, ffn_scale, ffn_gate = modulation
        kernel = self.fused_kernels
        if self.cross_attn_norm:
            x, h = residual_layer_norm(
                x,
                attended,
                gate,
                eps=self.norm2.eps,
                weight=self.norm2.weight,
                bias=self.norm2.bias,
                kernel=kernel,
                fp8="cross_q" in settings.fp8_layers,
                token_rows=token_rows,
                spare_columns=self.attn2.spare_columns(self_attention=False, fp8=fp8["attn2"]),
            )
        else:
            x = h = add_residual(x, attended, gate, kernel=kernel, token_rows=token_rows)
        # The cross-attention residual is a plain add in the model dtype, as the reference does.
        ffn_in = "ffn_in" in settings.fp8_layers
        up = self.ffn.net[0].proj
        crossed = self.attn2(
            h,
            call.text,
            call.metadata.cross_attn,
            call.attention,
            image=call.image,
            image_meta=call.metadata.image_cross_attn,
            fp8=fp8["attn2"],
        )
        x, h = residual_layer_norm(
            x,
            crossed,
            None,
            eps=self.norm3.eps,
            shift=ffn_shift,
            scale=ffn_scale,
            kernel=kernel,
            fp8=ffn_in,
            token_rows=token_rows,
            spare_columns=0 if ffn_in else concat_columns((up,), up.weight),
        )
        ffn = self.ffn(h, token_chunk=settings.ffn_chunk, fp8_layers=fp8["ffn"])
        return add_residual(x, ffn, ffn_gate, kernel=kernel, token_rows=token_rows)

    def _forward_chunked(
        self,
        x: torch.Tensor,
        modulation: tuple[torch.Tensor, ...],
        call: WanCall,
        fp8: dict[str, frozenset[str]],
    ) -> torch.Tensor:
        """forward() with every per-token op run on settings.block_chunk tokens at a time; the same values.

        Only the self-attention itself sees the whole sequence (its q, k, v are filled range by
        range, then attended at once); the modulated input, the q/k/v and output projections, the
        norms, RoPE, the cross-attention and the FFN never exist for more than one range. Peak: the
        input, q, k, v and the attention output ([B, S, dim] each) plus one range's temporaries,
        instead of about eight whole [B, S, dim] tensors and the FFN's [B, S, ffn_dim].
        """
        batch, tokens, dim = x.shape
        settings, token_rows, rope = call.settings, call.token_rows, call.rope
        step = settings.block_chunk
        spans = [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]
        # The vector tables are the same for every range; per-token indices are sliced with the tokens.
        shift, scale, *after = modulation
        heads = self.attn1.heads
        q = x.new_empty(batch, tokens, heads, dim // heads)
        k, v = torch.empty_like(q), torch.empty_like(q)
        quantized = "self_qkv" in settings.fp8_layers
        spare = self.attn1.spare_columns(self_attention=True, fp8=fp8["attn1"])
        for rows in spans:
            h = layer_norm_modulate(
                x[:, rows].contiguous(),
                eps=self.norm1.eps,
                shift=shift,
                scale=scale,
                kernel=self.fused_kernels,
                fp8=quantized,
                token_rows=None if token_rows is None else token_rows[:, rows],
                spare_columns=spare,
            )
            part = None if rope is None else (rope[0][:, rows], rope[1][:, rows])
            q[:, rows], k[:, rows], v[:, rows] = self.attn1.qkv(h, h, part, fp8["attn1"])
            del h
        impl = self._self_attention(call.attention, settings)
        # Padded rows when to_out runs "concat": each range's copy below then carries the spare columns.
        spare_out = self.attn1.output_spare_columns(impl, fp8["attn1"])
        out = self.attn1.attend(impl, q, k, v, call.metadata.self_attn, spare_out)
        del q, k, v
        result = torch.empty_like(x)
        for rows in spans:
            attended = self.attn1.output(out[:, rows].contiguous(), fp8["attn1"])
            result[:, rows] = self._after_self_attention(
                x[:, rows].contiguous(),
                attended,
                after,
                None if token_rows is None else token_rows[:, rows],
                call,
                fp8,
            )
            del attended
        return result


class WanImageEmbedder(nn.Module):
    """Image-encoder tokens [B, N, image_dim] -> LayerNorm -> Linear -> GELU -> Linear -> LayerNorm -> [B, N, dim].

    diffusers' WanImageEmbedding layout (norm1, ff.net.0.proj, ff.net.2, norm2, optional pos_embed).
    With pos_embed (FLF2V: first and last frame), the two images' tokens are joined into one
    sequence of pos_embed_seq_len tokens before the learned positions are added.
    """

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None = None) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim, 1e-5)
        self.ff = _GeluFeedForward(image_dim, dim)
        self.norm2 = FP32LayerNorm(dim, 1e-5)
        self.pos_embed = (
            None if pos_embed_seq_len is None else nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim))
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            image = image.reshape(-1, self.pos_embed.shape[1], image.shape[-1]) + self.pos_embed
        return self.norm2(self.ff(self.norm1(image)))


class _GeluFeedForward(nn.Module):
    """Linear(in, in) -> exact GELU -> Linear(in, out), weights at net.0.proj and net.2 (diffusers' names)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([_Projection(dim_in, dim_in), nn.Identity(), nn.Linear(dim_in, dim_out)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x)))


class _Projection(nn.Module):
    """Holds a Linear at `proj` (the checkpoint's name for the first FFN layer)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)


class WanConditionEmbedder(nn.Module):
    """Timestep -> (embedding [B, dim], 6-way projection [B, 6 * dim]); text [B, L, text_dim] -> [B, L, dim].

    With image_dim it also embeds image-encoder tokens (image_embedder, WanImageEmbedder).
    """

    def __init__(
        self,
        dim: int,
        freq_dim: int,
        text_dim: int,
        image_dim: int | None = None,
        pos_embed_seq_len: int | None = None,
    ) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = TimestepMLP(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TextProjection(text_dim, dim)
        if image_dim is not None:
            self.image_embedder = WanImageEmbedder(image_dim, dim, pos_embed_seq_len)

    def forward(
        self, timestep: torch.Tensor, text: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """timestep [B] (or [B, S] per token) float, text [B, L, text_dim] -> temb, projection, text [B, L, dim].

        temb [B, dim] and projection [B, 6 * dim]; per-token timesteps give [B, S, dim] and [B, S, 6 * dim].
        """
        temb, projection = self.timestep_embedding(timestep, text.dtype)
        return temb, projection, self.text_embedder(text)

    def timestep_embedding(
        self, timestep: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B] (or [B, S]) float -> temb [B, dim] and projection [B, 6 * dim] (or per token), in dtype.

        The time half of forward, alone: the step cache (pipelines.step_cache) reads it as its signal.
        """
        flat = timestep.flatten()
        # A one-row GEMM runs a matrix-vector kernel that rounds unlike the matrix kernel: a lone
        # timestep is embedded as two equal rows, so a batch-1 call (sequential CFG) gets exactly
        # the bits each row of the batch-2 call gets.
        lone = flat.numel() == 1
        features = timestep_sinusoid(flat.expand(2) if lone else flat, self.freq_dim)
        # The time MLP may be kept in float32 while the rest runs in bf16; its output joins `dtype`.
        features = features.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(features).to(dtype)
        projection = self.time_proj(F.silu(temb))
        if lone:
            temb, projection = temb[:1], projection[:1]
        return temb.unflatten(0, timestep.shape), projection.unflatten(0, timestep.shape)
