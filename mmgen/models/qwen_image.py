"""The Qwen-Image transformer (an MMDiT of dual-stream blocks) with explicit joint-attention metadata.

Shapes: latents [B, N, in_channels] are the VAE latents cut into 2x2 patches and packed as diffusers'
QwenImagePipeline packs them (N = the sum of the image grids' tokens); text [B, L, joint_attention_dim]
holds each prompt's encoder states from column 0, zero-padded to the batch's longest; the output
[B, N, patch_size**2 * out_channels] is in the latents' packing.

Text attention: Qwen-Image was trained with masked text, so padding is never attended. Each sample's
joint sequence is its own text_lens[b] text tokens and its N image tokens: the JointTokens and its
AttentionMetadata (varlen rows of text_lens[b] + N tokens, mmgen.models.qwen_image_joint) are built
once per call from text_lens and passed to every block, never a dense mask. A conditional and an
unconditional prompt of different lengths thus run as one call of batch 2. Without text_lens every
text token is attended (as diffusers without a mask).
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
from mmgen.errors import ValidationError
from mmgen.layers.embeddings import TimestepMLP
from mmgen.models.qwen_image_blocks import EPS, QwenImageBlock, QwenImageCall, RMSNorm, check_grids, qwen_rope
from mmgen.models.qwen_image_joint import JointTokens
from mmgen.models.settings import ExecutionSettings
from mmgen.parallel.layout import ParallelLayout

TIMESTEP_CHANNELS = 256
TIMESTEP_SCALE = 1000.0  # the model takes t in [0, 1] (the pipeline passes t / 1000) and scales it back
ROPE_THETA = 10000.0
# Keys of released config.json files that diffusers' model takes no argument for (it ignores them).
IGNORED_CONFIG_KEYS = frozenset({"pooled_projection_dim"})
# diffusers fields of later variants (Qwen-Image-Edit-2511, Qwen-Image-Layered) not built here yet.
UNSUPPORTED_FLAGS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


@dataclass(frozen=True)
class QwenImageConfig:
    """Architecture of a Qwen-Image transformer; field names and defaults are diffusers' (Qwen-Image 20B)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    guidance_embeds: bool = False
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(d) for d in self.axes_dims_rope))
        for name in ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim"):
            _require_positive(name, getattr(self, name))
        _require_positive("num_attention_heads", self.num_attention_heads)
        _require_positive("joint_attention_dim", self.joint_attention_dim)
        axes = self.axes_dims_rope
        if len(axes) != 3 or any(d < 2 or d % 2 for d in axes) or sum(axes) != self.attention_head_dim:
            raise ValidationError(
                f"QwenImageConfig.axes_dims_rope={axes}: expected 3 even positive dims summing to "
                f"attention_head_dim={self.attention_head_dim}"
            )
        for name in UNSUPPORTED_FLAGS:
            if getattr(self, name):
                raise ValidationError(
                    f"QwenImageConfig.{name}=True is not supported yet (Qwen-Image T2I has False)"
                )

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @staticmethod
    def from_diffusers(config: Mapping[str, Any]) -> QwenImageConfig:
        """From a diffusers config.json dict; "_"-prefixed keys and IGNORED_CONFIG_KEYS are skipped,
        any other unknown key raises (a field this code would silently drop)."""
        known = {field.name for field in fields(QwenImageConfig)}
        unknown = sorted(
            k for k in config if k not in known and k not in IGNORED_CONFIG_KEYS and k[:1] != "_"
        )
        if unknown:
            raise ValidationError(f"Qwen-Image config has unknown keys {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in config.items() if k in known}
        if values.get("out_channels") is None:
            values["out_channels"] = values.get("in_channels", QwenImageConfig.in_channels)
        return QwenImageConfig(**values)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValidationError(f"QwenImageConfig.{name} must be a positive int, got {value!r}")


def timestep_features(timestep: torch.Tensor, channels: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """float32 [B, channels], cosines first, of timestep [B] (diffusers' Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0, scale=1000) op for op: float32 frequencies, the angle scaled last)."""
    half = channels // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = TIMESTEP_SCALE * (timestep[:, None].float() * torch.exp(exponent)[None, :])
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class QwenTimestepEmbedding(nn.Module):
    """timestep [B] -> temb [B, dim] (the checkpoints' time_text_embed.timestep_embedder)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepMLP(TIMESTEP_CHANNELS, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        features = timestep_features(timestep.to(dtype))
        return self.timestep_embedder(features.to(dtype))


class AdaLayerNormOut(nn.Module):
    """The final norm: LayerNorm without weights, * (1 + scale) + shift; scale, shift = Linear(SiLU(temb))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim], temb [B, dim] -> [B, N, dim]."""
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=-1)
        return F.layer_norm(x, x.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None]


class QwenImageTransformer(nn.Module):
    """Qwen-Image's transformer; state-dict keys are those of diffusers' QwenImageTransformer2DModel."""

    def __init__(self, config: QwenImageConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.time_text_embed = QwenTimestepEmbedding(dim)
        self.txt_norm = RMSNorm(config.joint_attention_dim)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageBlock(dim, config.num_attention_heads, config.attention_head_dim)
            for _ in range(config.num_layers)
        )
        self.norm_out = AdaLayerNormOut(dim)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels)

    @property
    def blocks(self) -> nn.ModuleList:
        """The dual-stream blocks (what a layer-offload placement streams)."""
        return self.transformer_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def set_fused_kernels(self, enabled: bool) -> QwenImageTransformer:
        """The blocks' Triton row kernels on (default) or off, for A/B timing; returns self."""
        for block in self.transformer_blocks:
            block.set_fused_kernels(enabled)
        return self

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        attention: AttentionImpl,
        text_lens: torch.Tensor | Sequence[int] | None = None,
        metadata: JointTokens | None = None,
        parallel: ParallelLayout | None = None,
        settings: ExecutionSettings | None = None,
        grids: Sequence[tuple[int, int, int]],
    ) -> torch.Tensor:
        """latents [B, N, in_channels], timestep [B] float in [0, 1], text [B, L, joint_attention_dim]
        -> [B, N, patch_size**2 * out_channels] in the model's dtype.

        The DiT call contract (mmgen.models.call). text_lens [B]: each prompt's tokens (the rest of
        its row is padding, never attended); None: all L are text. metadata: JointTokens.build's
        value for these lengths, when the caller built it already (then no text_lens). parallel:
        None or a layout without sequence parallelism (CFG parallel splits the calls, not one call).
        settings: only a block stream (layer offload, mmgen.placement.BlockStream) applies here;
        chunks and FP8 are refused. grids: the (frames, height, width) token grid of each image in
        the latents, in token order (Qwen-Image T2I: one, (1, H / 16, W / 16)); shared by every sample.
        """
        batch, image_tokens = latents.shape[:2]
        grids = check_grids(grids, image_tokens)
        self._check_inputs(latents, timestep, text)
        settings = _check_call_settings(settings, parallel)
        if metadata is None:
            lens = [text.shape[1]] * batch if text_lens is None else text_lens
            metadata = JointTokens.build(lens, image_tokens, text_width=text.shape[1], device=text.device)
        elif text_lens is not None or (metadata.text_width, metadata.image_tokens) != (
            text.shape[1],
            image_tokens,
        ):
            raise ValidationError(
                f"metadata: a JointTokens layout for {metadata.text_width} text + {metadata.image_tokens} "
                f"image tokens does not fit text {tuple(text.shape)} and latents {tuple(latents.shape)}, "
                "or came with text_lens (give one)"
            )
        rope = qwen_rope(
            grids, text.shape[1], self.config.axes_dims_rope, theta=ROPE_THETA, device=latents.device
        )
        image = self.img_in(latents.to(self.dtype))
        text = self.txt_in(self.txt_norm(text.to(self.dtype)))
        temb = self.time_text_embed(timestep, self.dtype)
        call = QwenImageCall(attention=attention, metadata=metadata, rope=rope, temb=temb, settings=settings)
        for block in settings.blocks(self.transformer_blocks):
            image, text = block(image, text, call)
        return self.proj_out(self.norm_out(image, temb))

    def _check_inputs(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> None:
        config = self.config
        if latents.dim() != 3 or latents.shape[-1] != config.in_channels:
            raise ValidationError(
                f"latents {tuple(latents.shape)}: expected [B, N, in_channels={config.in_channels}]"
            )
        if (
            text.dim() != 3
            or text.shape[0] != latents.shape[0]
            or text.shape[-1] != config.joint_attention_dim
        ):
            raise ValidationError(
                f"text {tuple(text.shape)}: expected [B={latents.shape[0]}, L, "
                f"joint_attention_dim={config.joint_attention_dim}]"
            )
        if tuple(timestep.shape) != (latents.shape[0],):
            raise ValidationError(f"timestep {tuple(timestep.shape)}: expected [B={latents.shape[0]}]")


def _check_call_settings(
    settings: ExecutionSettings | None, parallel: ParallelLayout | None
) -> ExecutionSettings:
    """The call's settings (None: the defaults); what this model does not run yet raises, naming it."""
    if parallel is not None and parallel.sp_degree > 1:
        raise ValidationError(
            f"parallel: Qwen-Image runs no sequence parallelism yet (sp_degree {parallel.sp_degree}; allowed: 1)"
        )
    settings = ExecutionSettings() if settings is None else settings
    unsupported = [
        name
        for name, value in (
            ("ffn_chunk", settings.ffn_chunk),
            ("block_chunk", settings.block_chunk),
            ("fp8_layers", settings.fp8_layers),
            ("fp8_attention", settings.fp8_attention),
        )
        if value
    ]
    if unsupported:
        raise ValidationError(
            f"settings: Qwen-Image does not run {', '.join(unsupported)} yet (allowed: block_stream only)"
        )
    return settings


def true_cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG: uncond + scale * (cond - uncond), rescaled per token to cond's norm.

    cond, uncond: [B, N, C] model outputs (the norms are over the packed channels C, per token).
    """
    combined = uncond + scale * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
