"""Wan2.1 VACE: the Wan DiT plus a stack of control blocks that add "hints" into chosen main blocks.

Shapes: latents [B, C, F, H, W] and text as WanDiT's; control [B, vace_in_channels, F, H, W] (the
conditioning latents the VACE pipeline prepares: inactive and reactive video latents and the packed
mask, 96 channels for Wan2.1 VACE) over the same latent grid as latents.

The control stream: control is patch-embedded (vace_patch_embedding), the first VACE block adds the
main stream's patch tokens to its proj_in output, and every VACE block is a Wan block (same
timestep modulation, RoPE tables and text) followed by proj_out, whose output is a hint: the k-th
VACE block's goes to the k-th smallest index in vace_layers (as diffusers pairs them, whatever the
listed order). Each hint, times its scale, is added to the main stream right after that block; the
control stream never reads the main stream again. Hints are made lazily, each just before the main
block that takes it, so one hint lives at a time (the reference makes them all first: the same
values). Under sequence parallelism the control tokens are sharded with the main stream's plan.

Parameter names are diffusers' WanVACETransformer3DModel's, so its state dict loads as it is.
The control tokens get their own DiTAttention (control_metadata), built once per call like the
main stream's; both are dense over the same grid here, but nothing ties one to the other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import DiTAttention
from mmgen.errors import ValidationError
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanConfig, WanDiT, embed_patches
from mmgen.models.wan_blocks import WanBlock, WanCall
from mmgen.parallel.layout import ParallelLayout

VACE_FIELDS = ("vace_layers", "vace_in_channels")
# The original Wan2.1-VACE config's names of those fields (its model_type is "vace").
ORIGINAL_VACE_FIELDS = ("vace_layers", "vace_in_dim")


@dataclass(frozen=True)
class WanVACEConfig(WanConfig):
    """A Wan DiT config plus VACE's fields (diffusers' WanVACETransformer3DModel names and meanings).

    vace_layers: the main blocks that take a hint, one VACE block each (distinct, in [0, num_layers),
    0 among them: the first VACE block is the one with proj_in); vace_in_channels: control channels.
    """

    vace_layers: tuple[int, ...] = (0, 5, 10, 15, 20, 25, 30, 35)
    vace_in_channels: int = 96

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "vace_layers", tuple(self.vace_layers))
        layers = self.vace_layers
        if (
            not layers
            or any(not isinstance(i, int) or isinstance(i, bool) for i in layers)
            or len(set(layers)) != len(layers)
            or min(layers) < 0
            or max(layers) >= self.num_layers
            or 0 not in layers
        ):
            raise ValidationError(
                f"WanVACEConfig.vace_layers must be distinct block indices in [0, {self.num_layers}) "
                f"including 0, got {list(layers)}"
            )
        if not isinstance(self.vace_in_channels, int) or self.vace_in_channels < 1:
            raise ValidationError(
                f"WanVACEConfig.vace_in_channels must be a positive int, got {self.vace_in_channels!r}"
            )
        if self.has_image_path:
            raise ValidationError("WanVACEConfig: an image path (image_dim) is not supported with VACE")

    @property
    def hint_layers(self) -> tuple[int, ...]:
        """The main blocks that take hints, in the order the VACE blocks make them (increasing)."""
        return tuple(sorted(self.vace_layers))

    @staticmethod
    def from_diffusers_config(raw: dict) -> WanVACEConfig:
        """From a diffusers WanVACETransformer3DModel config.json dict; unknown keys raise."""
        rest = {key: value for key, value in raw.items() if key not in VACE_FIELDS}
        base = WanConfig.from_diffusers_config(rest)
        vace = {key: raw[key] for key in VACE_FIELDS if key in raw}
        return WanVACEConfig(**{f.name: getattr(base, f.name) for f in fields(WanConfig)}, **vace)

    @staticmethod
    def from_original_config(raw: dict, *, vace_in_dim: int | None = None) -> WanVACEConfig:
        """From the original Wan2.1-VACE config.json (WanConfig.from_original_config's fields, model_type
        "vace", vace_layers, vace_in_dim). vace_in_dim, when the file lacks it: the caller's (the
        width of the checkpoint's vace_patch_embedding); vace_layers is required.
        """
        model_type = raw.get("model_type", "vace")
        if model_type != "vace":
            raise ValidationError(f"original Wan VACE config has model_type {model_type!r}; expected 'vace'")
        layers = raw.get("vace_layers")
        channels = raw.get("vace_in_dim", vace_in_dim)
        if layers is None or channels is None:
            missing = [
                name for name, value in (("vace_layers", layers), ("vace_in_dim", channels)) if value is None
            ]
            raise ValidationError(f"original Wan VACE config lacks {', '.join(missing)}")
        rest = {key: value for key, value in raw.items() if key not in ORIGINAL_VACE_FIELDS}
        base = WanConfig.from_original_config({**rest, "model_type": "t2v"})
        return WanVACEConfig(
            **{f.name: getattr(base, f.name) for f in fields(WanConfig)},
            vace_layers=tuple(layers),
            vace_in_channels=channels,
        )

    def to_diffusers_config(self) -> dict:
        """The diffusers WanVACETransformer3DModel config dict (without mmgen's text_len / text_mask)."""
        raw = asdict(self)
        del raw["text_len"], raw["text_mask"]
        raw["patch_size"] = list(self.patch_size)
        raw["vace_layers"] = list(self.vace_layers)
        return raw


class WanVACEBlock(WanBlock):
    """A Wan block over the control tokens, with proj_in (the first VACE block only) and proj_out (the hint)."""

    def __init__(self, dim: int, ffn_dim: int, heads: int, *, first: bool, cross_attn_norm: bool, eps: float):
        super().__init__(dim, ffn_dim, heads, cross_attn_norm=cross_attn_norm, eps=eps)
        self.proj_in = nn.Linear(dim, dim) if first else None
        self.proj_out = nn.Linear(dim, dim)

    def forward_control(self, control: torch.Tensor, call: WanCall) -> tuple[torch.Tensor, torch.Tensor]:
        """control [B, S, dim] -> (control, hint), both [B, S, dim].

        call: the control stream's record: the main call's (its patch tokens call.x, text,
        modulation, RoPE, impl, settings) with the control stream's DiTAttention as its metadata.
        """
        if self.proj_in is not None:
            control = self.proj_in(control) + call.x
        # Through __call__ (the inherited WanBlock.forward), so compile_blocks' compiled block runs.
        control = self(control, call)
        return control, self.proj_out(control)


class WanVACEDiT(WanDiT):
    """The Wan DiT with VACE's control blocks; state-dict keys equal diffusers' WanVACETransformer3DModel's."""

    def __init__(self, config: WanVACEConfig) -> None:
        super().__init__(config)
        self.vace_patch_embedding = nn.Conv3d(
            config.vace_in_channels, config.dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.vace_blocks = nn.ModuleList(
            WanVACEBlock(
                config.dim,
                config.ffn_dim,
                config.num_attention_heads,
                first=index == 0,
                cross_attn_norm=config.cross_attn_norm,
                eps=config.eps,
            )
            for index in range(len(config.vace_layers))
        )

    def fuse_projections(self) -> WanVACEDiT:
        """As WanDiT.fuse_projections, for the VACE blocks too; returns self."""
        super().fuse_projections()
        for block in self.vace_blocks:
            block.fuse_projections()
        return self

    def set_fused_kernels(self, enabled: bool) -> WanVACEDiT:
        """As WanDiT.set_fused_kernels, for the VACE blocks too; returns self."""
        super().set_fused_kernels(enabled)
        for block in self.vace_blocks:
            block.set_fused_kernels(enabled)
        return self

    def compile_blocks(self, *, fuse: bool = True, **options: Any) -> WanVACEDiT:
        """As WanDiT.compile_blocks, for the VACE blocks too (they share the Wan block's code); returns self."""
        super().compile_blocks(fuse=fuse, **options)
        for block in self.vace_blocks:
            block.compile(**options)
        return self

    def release_fp8_weights(self) -> WanVACEDiT:
        """As WanDiT.release_fp8_weights, for the VACE blocks too; returns self."""
        super().release_fp8_weights()
        for block in self.vace_blocks:
            block.release_fp8_weights()
        return self

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        attention: AttentionImpl,
        control: torch.Tensor,
        control_scale: float | Sequence[float] = 1.0,
        text_lens: torch.Tensor | None = None,
        metadata: DiTAttention | None = None,
        control_metadata: DiTAttention | None = None,
        parallel: ParallelLayout | None = None,
        settings: ExecutionSettings | None = None,
    ) -> torch.Tensor:
        """latents [B, C, F, H, W], timestep [B], text [B, L, text_dim], control [B, vace_in_channels, F, H, W]
        -> [B, C_out, F, H, W] (model dtype).

        control_scale: this call's hint scale, one number for every hint or one per VACE block
        (diffusers' control_hidden_states_scale), rounded to the model dtype as diffusers' pipeline
        does. control_metadata: the control stream's DiTAttention; None = built here like the main
        stream's (from text_lens). The rest as WanDiT.forward's; under sequence parallelism the
        control tokens are sharded like the main stream's. A block stream (layer offload) is refused.
        """
        if settings is not None and settings.block_stream is not None:
            raise ValidationError("Wan VACE: layer offload (a block stream) is not supported yet")
        scales = self._check_control(latents, control, control_scale)
        call = self.prepare_call(
            latents,
            timestep,
            text,
            attention=attention,
            text_lens=text_lens,
            metadata=metadata,
            parallel=parallel,
            settings=settings,
        )
        if control_metadata is None:
            control_metadata = self.build_attention_metadata(
                None if text_lens is None else text_lens.to(text.device), text_len=text.shape[1]
            )
        tokens = embed_patches(self.vace_patch_embedding, control.to(self.dtype))
        if call.shard is not None:
            # The control tokens are split like the main stream's (the same plan: the hints add row to row).
            if not control_metadata.self_attn.is_dense:
                raise ValidationError("sequence parallel: the control self-attention metadata must be dense")
            local = call.shard.metadata(tokens.shape[0], tokens.device)
            control_metadata = replace(control_metadata, self_attn=local)
            tokens = call.shard.split(tokens)
        # The scales in the model dtype, as diffusers' pipeline hands them to its model.
        scales = torch.tensor(scales, dtype=self.dtype, device=latents.device).unbind()
        hints = self.control_hints(call, tokens, scales, control_metadata)
        return self.finish_call(call, self.run_blocks(call, hints))

    def control_hints(
        self,
        call: WanCall,
        control: torch.Tensor,
        scales: Sequence[torch.Tensor],
        metadata: DiTAttention,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(main block index, scaled hint [B, S, dim]) in block order, each made when drawn.

        control: the control tokens [B, S, dim] (vace_patch_embedding's output); scales: one per
        VACE block (0-dim tensors); metadata: the control stream's DiTAttention.
        """
        # The control stream's record: the main call's with its own metadata (once per call).
        call = replace(call, metadata=metadata)
        for block, layer, scale in zip(self.vace_blocks, self.config.hint_layers, scales, strict=True):
            control, hint = block.forward_control(control, call)
            yield layer, hint * scale

    def _check_control(
        self, latents: torch.Tensor, control: torch.Tensor, scale: float | Sequence[float]
    ) -> tuple[float, ...]:
        """Checks control against latents; the hint scales, one per VACE block."""
        expected = (latents.shape[0], self.config.vace_in_channels, *latents.shape[2:])
        if control.dim() != 5 or tuple(control.shape) != expected:
            # diffusers zero-pads a control with fewer tokens; mmgen asks for the latents' grid.
            raise ValidationError(
                f"control must be {list(expected)} (the latents' grid), got {list(control.shape)}"
            )
        blocks = len(self.vace_blocks)
        scales = (scale,) * blocks if isinstance(scale, (int, float)) else tuple(scale)
        if len(scales) != blocks or not all(isinstance(s, (int, float)) for s in scales):
            raise ValidationError(
                f"control_scale must be a number or {blocks} numbers (one per VACE block), got {scale!r}"
            )
        return tuple(float(s) for s in scales)
