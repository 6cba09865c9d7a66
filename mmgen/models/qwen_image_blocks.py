"""The pieces of the Qwen-Image transformer: its RoPE tables, joint attention and dual-stream block.

Parameter names follow diffusers' QwenImageTransformer2DModel so diffusers-format checkpoints load as
they are. Dtypes follow it too: norms, modulation and residuals run in the model's dtype, except
the q/k RMSNorm variance and the rotation, which compute in float32.

Joint attention: each block projects the text stream [B, L, dim] (padded to the batch's longest
prompt) and the image stream [B, N, dim] to q, k, v and attends over one sequence per sample, laid
out by a JointTokens (mmgen.models.qwen_image_joint): that sample's prompt tokens, then its image
tokens, its padding last and never attended. Every block reads the call's JointTokens, RoPE tables,
timestep embedding, impl and settings from one QwenImageCall record (mmgen.models.call).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mmgen.attention.impls import AttentionImpl
from mmgen.errors import ValidationError
from mmgen.layers.fused_norms import (
    add_residual,
    head_rms_norm_rope,
    kernel_applies,
    layer_norm_modulate,
    residual_layer_norm,
)
from mmgen.layers.mlp import GeluTanhFeedForward
from mmgen.models.call import DiTCall
from mmgen.models.qwen_image_joint import JointTokens

EPS = 1e-6


# ---------------------------------------------------------------------------------------------------
# RoPE: three axes (frame, height, width); text tokens continue after the image's largest position


@dataclass(frozen=True)
class QwenRope:
    """Rotations of one model call: complex64 [1, S, 1, head_dim // 2] (diffusers' freqs_cis layout)."""

    image_freqs: torch.Tensor
    text_freqs: torch.Tensor

    # The same rotations as the row kernels take them, (cos_full, sin_signed) float32 [S, head_dim]:
    # made when the first fused block reads them, then shared by the call's other blocks.
    @functools.cached_property
    def image_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _real_tables(self.image_freqs)

    @functools.cached_property
    def text_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _real_tables(self.text_freqs)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate image q or k [B, N, H, D]."""
        return _rotate(x, self.image_freqs)

    def text(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate text q or k [B, L, H, D]."""
        return _rotate(x, self.text_freqs)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with pairs (2i, 2i + 1) as complex numbers, times freqs [1, S, 1, D // 2], in x's
    dtype: diffusers' apply_rotary_emb_qwen (use_real=False) op for op, a float32 complex product. The
    real-arithmetic form (x * cos + rotated * sin) rounds differently in the last float32 place, which
    a bf16 cast then shows now and then (found at t = 1.0 on CPU)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(3).type_as(x)


def _real_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """complex [1, S, 1, D // 2] -> (cos_full, sin_signed) float32 [S, D] (mmgen.layers.rotary's form:
    cos at 2i and 2i + 1, -sin at 2i, +sin at 2i + 1)."""
    cos, sin = freqs[0, :, 0].real.float(), freqs[0, :, 0].imag.float()
    return torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)


def _axis_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """float32 [P, dim // 2]: position * theta ** (-2i / dim), in the same float32 ops as diffusers'
    rope_params, so the tables match its bits (not float64 angles: those would differ in the last place)."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, device=positions.device).float().div(dim))
    return torch.outer(positions.float(), inv_freq)


def _freqs(angles: torch.Tensor) -> torch.Tensor:
    """angles [S, D // 2] -> complex64 [1, S, 1, D // 2] unit rotations (torch.polar, as diffusers)."""
    return torch.polar(torch.ones_like(angles), angles)[None, :, None, :]


def centered_positions(length: int, device: torch.device | str) -> torch.Tensor:
    """Positions -(length - length // 2) .. length // 2 - 1 (scale_rope: the grid's middle at 0)."""
    return torch.arange(length, device=device) - (length - length // 2)


def qwen_rope(
    grids: Sequence[tuple[int, int, int]],
    text_width: int,
    axes_dims: tuple[int, int, int],
    *,
    theta: float = 10000.0,
    device: torch.device | str = "cpu",
) -> QwenRope:
    """The tables for image grids (frames, height, width) in token order, then text_width text tokens.

    Image grid i takes frame positions i .. i + frames - 1 and centered height/width positions; the
    text token j takes position m + j on every axis, m = the largest max(height // 2, width // 2) of
    the grids (diffusers' QwenEmbedRope with scale_rope=True).
    """
    image_angles = []
    for index, (frames, height, width) in enumerate(grids):
        axes = (
            torch.arange(index, index + frames, device=device),
            centered_positions(height, device),
            centered_positions(width, device),
        )
        parts = [_axis_angles(pos, dim, theta) for pos, dim in zip(axes, axes_dims, strict=True)]
        shape = (frames, height, width)
        parts = [
            part.view(*[n if axis == a else 1 for a, n in enumerate(shape)], -1).expand(*shape, -1)
            for axis, part in enumerate(parts)
        ]
        image_angles.append(torch.cat(parts, dim=-1).reshape(frames * height * width, -1))
    start = max(max(height // 2, width // 2) for _, height, width in grids)
    text_positions = torch.arange(start, start + text_width, device=device)
    text_angles = torch.cat([_axis_angles(text_positions, dim, theta) for dim in axes_dims], dim=-1)
    return QwenRope(_freqs(torch.cat(image_angles)), _freqs(text_angles))


@dataclass(frozen=True, kw_only=True)
class QwenImageCall(DiTCall):
    """Qwen-Image's record of one model call (mmgen.models.call), built once by its forward.

    metadata: the JointTokens of the call's joint sequence; rope: its QwenRope tables; temb [B, dim]:
    the timestep embedding every block modulates from; attention, settings as DiTCall's. The two
    streams (image [B, N, dim], text [B, L, dim]) are the blocks' arguments, not in the record.
    """

    metadata: JointTokens
    rope: QwenRope


# ---------------------------------------------------------------------------------------------------
# Joint attention


class RMSNorm(nn.Module):
    """x [..., dim] -> x / rms(x) * weight, the variance in float32 (diffusers' RMSNorm: the normed
    value is rounded to a bf16/fp16 weight's dtype before the weight multiplies it)."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            normed = normed.to(self.weight.dtype)
        return normed * self.weight


def joint_attend(
    attention: AttentionImpl,
    text_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    image_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    joint: JointTokens,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text q/k/v [B, L, H, D] and image q/k/v [B, N, H, D] -> outputs [B, L, H, D] and [B, N, H, D].

    One attention call over the joint rows with their metadata; padded text queries get 0.
    """
    q, k, v = (joint.join(text, image) for text, image in zip(text_qkv, image_qkv, strict=True))
    return joint.split(attention(q, k, v, joint.metadata))


class QwenJointAttention(nn.Module):
    """The joint attention of one dual-stream block: separate projections per stream, one attention call.

    Per-head RMSNorm on q and k of each stream (norm_q/norm_k for the image, norm_added_q/norm_added_k
    for the text), then RoPE, then joint_attend; to_out[0] projects the image part, to_add_out the text.
    """

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim)
        self.norm_k = RMSNorm(head_dim)
        self.norm_added_q = RMSNorm(head_dim)
        self.norm_added_k = RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # index 0, as the checkpoints name it
        self.to_add_out = nn.Linear(inner, dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def forward(
        self, image: torch.Tensor, text: torch.Tensor, call: QwenImageCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """image [B, N, dim], text [B, L, dim] -> their attention outputs [B, N, dim], [B, L, dim]
        (call.rope rotates, call.metadata lays out the joint rows, call.attention attends)."""
        rope = call.rope
        image_qkv = (
            rope.image(self.norm_q(self._heads(self.to_q(image)))),
            rope.image(self.norm_k(self._heads(self.to_k(image)))),
            self._heads(self.to_v(image)),
        )
        text_qkv = (
            rope.text(self.norm_added_q(self._heads(self.add_q_proj(text)))),
            rope.text(self.norm_added_k(self._heads(self.add_k_proj(text)))),
            self._heads(self.add_v_proj(text)),
        )
        text_out, image_out = joint_attend(call.attention, text_qkv, image_qkv, call.metadata)
        dtype = image_qkv[0].dtype
        image_out = self.to_out[0](image_out.flatten(2).to(dtype))
        return image_out, self.to_add_out(text_out.flatten(2).to(dtype))

    def forward_fused(
        self, image: torch.Tensor, text: torch.Tensor, call: QwenImageCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with the joint rows written in place: each projection's q and k go through one
        RMSNorm + RoPE kernel pass straight into the joint q/k rows (no separate rotate, join or split
        copies), and to_out reads each sample's image rows where the attention wrote them."""
        rope, seq = call.rope, call.metadata  # seq: the JointTokens
        batch, image_tokens, _ = image.shape
        inner = self.heads * self.head_dim
        rows = batch * (seq.text_width + image_tokens)
        joint = [image.new_empty(rows, inner) for _ in range(3)]
        streams = (
            (image, (self.to_q, self.to_k), (self.norm_q, self.norm_k), seq.image_index, rope.image_table),
            (
                text,
                (self.add_q_proj, self.add_k_proj),
                (self.norm_added_q, self.norm_added_k),
                seq.text_index,
                rope.text_table,
            ),
        )
        for x, projections, norms, index, table in streams:
            for target, projection, norm in zip(joint[:2], projections, norms, strict=True):
                head_rms_norm_rope(
                    projection(x), norm.weight, norm.eps, out=target, out_rows=index, rope=table
                )
        # v needs no row pass: each sample's image v goes from the GEMM into its joint rows.
        for sample in range(batch):
            _linear_into(self.to_v, image[sample], joint[2][seq.image_rows(sample)])
        joint[2].index_copy_(0, seq.text_index, self.add_v_proj(text).reshape(-1, inner))
        q, k, v = (buffer.view(batch, -1, self.heads, self.head_dim) for buffer in joint)
        # Key lengths only: a padded text row's query is computed over its sample's keys, never read.
        out = call.attention(q, k, v, seq.key_metadata).reshape(rows, inner)
        image_out = image.new_empty(image.shape)
        for sample in range(batch):
            _linear_into(self.to_out[0], out[seq.image_rows(sample)], image_out[sample])
        text_out = self.to_add_out(out.index_select(0, seq.text_index)).view(text.shape)
        return image_out, text_out


def _linear_into(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """out[...] = layer(x) for x [S, in], out [S, out] contiguous: a plain Linear writes there directly
    (addmm; inference only, out= ops take no gradients); otherwise compute, then copy."""
    grad = torch.is_grad_enabled() and layer.weight.requires_grad
    if type(layer) is nn.Linear and layer.bias is not None and not grad:
        torch.addmm(layer.bias, x, layer.weight.t(), out=out)
    else:
        out.copy_(layer(x))


# ---------------------------------------------------------------------------------------------------
# Dual-stream block


def _modulations(params: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """[B, 6 * dim] -> (shift, scale, gate) of the attention half and of the MLP half, each [B, 1, dim]."""
    attn_half, mlp_half = params[:, None].chunk(2, dim=-1)
    return attn_half.chunk(3, dim=-1), mlp_half.chunk(3, dim=-1)


def _modulate(x: torch.Tensor, mod: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x [B, S, dim] * (1 + scale) + shift, in x's dtype (as diffusers' _modulate)."""
    shift, scale, _ = mod
    return x * (1 + scale) + shift


def _gated(x: torch.Tensor, update: torch.Tensor, mod: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x + gate * update, x/update [B, S, dim]."""
    return x + mod[2] * update


def _float_modulations(params: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """_modulations as the row kernels take them: float32 [B, 1, dim] views of one float32 copy."""
    return _modulations(params.float())


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    # diffusers clips both streams in float16 after every block, to keep them finite.
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class QwenImageBlock(nn.Module):
    """One MMDiT block: image and text streams with their own modulation, norms and MLPs, one joint attention.

    img_mod / txt_mod: SiLU then Linear(dim, 6 * dim) of the timestep embedding -> (shift, scale, gate)
    for the attention half, then for the MLP half.
    """

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.attn = QwenJointAttention(dim, heads, head_dim)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.img_mlp = GeluTanhFeedForward(dim, 4 * dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_mlp = GeluTanhFeedForward(dim, 4 * dim)
        self.fused_kernels = True

    def set_fused_kernels(self, enabled: bool) -> None:
        """The Triton row kernels on or off (model setup, for A/B timing; they run only on CUDA)."""
        self.fused_kernels = bool(enabled)

    def forward(
        self, image: torch.Tensor, text: torch.Tensor, call: QwenImageCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """image [B, N, dim], text [B, L, dim] -> the updated (image, text); call.temb [B, dim]."""
        if kernel_applies(image, self.fused_kernels):
            return self.forward_fused(image, text, call)
        img_attn_mod, img_mlp_mod = _modulations(self.img_mod(call.temb))
        txt_attn_mod, txt_mlp_mod = _modulations(self.txt_mod(call.temb))
        image_attn, text_attn = self.attn(
            _modulate(self.img_norm1(image), img_attn_mod),
            _modulate(self.txt_norm1(text), txt_attn_mod),
            call,
        )
        image = _gated(image, image_attn, img_attn_mod)
        text = _gated(text, text_attn, txt_attn_mod)
        image = _gated(image, self.img_mlp(_modulate(self.img_norm2(image), img_mlp_mod)), img_mlp_mod)
        text = _gated(text, self.txt_mlp(_modulate(self.txt_norm2(text), txt_mlp_mod)), txt_mlp_mod)
        return _clip_fp16(image), _clip_fp16(text)

    def forward_fused(
        self, image: torch.Tensor, text: torch.Tensor, call: QwenImageCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with the row passes as Triton kernels (mmgen.layers.fused_norms): LayerNorm +
        modulation in one pass, gated residual + the next LayerNorm + modulation in one, the gated MLP
        residual in one. They compute in float32 and round once, where the torch path rounds the
        modulated values to the model's dtype between ops: the two differ by bf16 rounding. forward()
        takes it on CUDA; elsewhere the same steps run as the kernels' torch references (tests)."""
        img_attn_mod, img_mlp_mod = _float_modulations(self.img_mod(call.temb))
        txt_attn_mod, txt_mlp_mod = _float_modulations(self.txt_mod(call.temb))
        image_attn, text_attn = self.attn.forward_fused(
            layer_norm_modulate(image, eps=EPS, shift=img_attn_mod[0], scale=img_attn_mod[1]),
            layer_norm_modulate(text, eps=EPS, shift=txt_attn_mod[0], scale=txt_attn_mod[1]),
            call,
        )
        image, image_normed = residual_layer_norm(
            image, image_attn, img_attn_mod[2], eps=EPS, shift=img_mlp_mod[0], scale=img_mlp_mod[1]
        )
        text, text_normed = residual_layer_norm(
            text, text_attn, txt_attn_mod[2], eps=EPS, shift=txt_mlp_mod[0], scale=txt_mlp_mod[1]
        )
        image = add_residual(image, self.img_mlp(image_normed), img_mlp_mod[2])
        text = add_residual(text, self.txt_mlp(text_normed), txt_mlp_mod[2])
        return _clip_fp16(image), _clip_fp16(text)


def check_grids(grids: Sequence[tuple[int, int, int]], image_tokens: int) -> tuple[tuple[int, int, int], ...]:
    """grids as a tuple of positive (frames, height, width) int triples holding image_tokens tokens in all."""
    try:
        grids = tuple(tuple(int(n) for n in grid) for grid in grids)
    except (TypeError, ValueError) as error:
        raise ValidationError(
            f"image grids must be (frames, height, width) int triples, got {grids!r}"
        ) from error
    if not grids or any(len(g) != 3 or min(g) < 1 for g in grids):
        raise ValidationError(
            f"image grids must be (frames, height, width) positive int triples, got {grids!r}"
        )
    total = sum(f * h * w for f, h, w in grids)
    if total != image_tokens:
        raise ValidationError(f"image grids {grids} hold {total} tokens, but the latents have {image_tokens}")
    return grids
