"""Wan video generation: prompt (+ image) -> UMT5 text -> seeded noise -> DiT denoise loop -> VAE -> frames.

One pipeline for every Wan variant (pipelines.wan_variant): Wan2.1 T2V / I2V / VACE, Wan2.2 T2V-A14B
and I2V-A14B (two experts) and TI2V-5B. The variant is read once from the components; it decides what
the request's Conditioning holds and which expert each step runs (pipelines.denoise).

A call is one GenerationRequest (pipelines.request) made into work in three steps (DESIGN.md), the
same for every family (pipelines.pipeline.Pipeline): `prepare` (pipelines.plan: the frozen plan,
every error before any work), `run` (pipelines.run: the one denoise loop over the plan) and
`record` (pipelines.record: the result); what Wan does differently is its hooks
(pipelines.wan_family.WanHooks). The pipeline itself holds what lives across calls: the
components, the variant, the layout, the placement of the weights and the LoRAs now applied.

Numerically this is diffusers' WanPipeline / WanImageToVideoPipeline (same text handling, image
preprocessing, noise, scheduler calls, guidance formula, latent denormalization and uint8
conversion); it differs in how work is organized: cond and uncond run as one batch-2 DiT call, the
attention impl, its metadata and the execution settings are values passed to the model, and the
result carries hashes, timings and the environment fingerprint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.loading.diffusers_dir import load_wan_components, wan_read_bytes
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.loading.wan_components import (
    WAN21_T2V_DEFAULTS,
    GenerationDefaults,
    WanComponents,
    check_compatible,
)
from mmgen.lora import LoRASlot
from mmgen.models.clip_vision import ClipImagePreprocess, ClipVisionEncoder
from mmgen.models.umt5 import UMT5Encoder
from mmgen.models.wan import WanDiT
from mmgen.models.wan_vace import WanVACEDiT
from mmgen.parallel.launch import resolve_layout, settled
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.parallel.share import reads_for_world, share_reads, split_reads
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.policy import check_budget, check_offload
from mmgen.placement.tensors import PinnedStore
from pipelines.capabilities import Capabilities
from pipelines.conditioning import ImageParts, build_conditioning, encode_text
from pipelines.denoise import Conditioning, Placement, ResidentPlacement
from pipelines.devices import check_device, check_dtype
from pipelines.pipeline import Pipeline
from pipelines.plan import GenerationPlan
from pipelines.wan_family import WanHooks
from pipelines.wan_variant import WanVariant

WAN_HOOKS = WanHooks()


class WanT2VPipeline(Pipeline):
    """Any Wan variant (T2V, I2V, TI2V, two experts); `pipe(prompt, ..., image=)` returns a GenerationResult.

    The name is historical: text-to-video is the variant that needs no image.
    """

    def __init__(
        self,
        transformer: WanDiT,
        text_encoder: UMT5Encoder,
        tokenizer: TextTokenizer,
        vae: Any,
        scheduler: Any,
        *,
        defaults: GenerationDefaults | None = None,
        source: Path | None = None,
        layout: ParallelLayout | None = None,
        placement: Placement | None = None,
        transformer_2: WanDiT | None = None,
        image_encoder: ClipVisionEncoder | None = None,
        image_preprocess: ClipImagePreprocess | None = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        device: str | torch.device | None = None,
        offload: str | None = None,
        gpu_memory_gb: float | None = None,
        host: PinnedStore | None = None,
    ) -> None:
        defaults = WAN21_T2V_DEFAULTS if defaults is None else defaults
        self.hooks = WAN_HOOKS
        # Values chosen once per pipeline and passed down to every step (DESIGN.md): which process
        # this is among several, and where the weights live.
        self.layout = ParallelLayout.single() if layout is None else layout
        self.placement = ResidentPlacement() if placement is None else placement
        if image_encoder is not None and image_preprocess is None:
            image_preprocess = ClipImagePreprocess()
        # Where the DiT computes (the weights may be elsewhere under offload); the offload mode and
        # GPU budget calls use unless they name their own (see mmgen.placement).
        self._device = transformer.patch_embedding.weight.device if device is None else torch.device(device)
        self.offload = None if offload is None else check_offload(offload)
        self.gpu_memory_gb = check_budget(gpu_memory_gb)
        self._explicit_placement = placement is not None
        # The page-locked buffers the weights were loaded into (from_pretrained with offload): the
        # first placement keeps them as its host copies and closes the store.
        self._host = host
        self.layout.check_heads(transformer.config.num_attention_heads)
        self.components = WanComponents(
            transformer,
            text_encoder,
            tokenizer,
            vae,
            scheduler,
            defaults,
            source,
            transformer_2=transformer_2,
            image_encoder=image_encoder,
            image_preprocess=image_preprocess,
            boundary_ratio=boundary_ratio,
            expand_timesteps=expand_timesteps,
        )
        check_compatible(self.components)
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValidationError("transformer_2 and boundary_ratio come together (Wan2.2 A14B); got one")
        self.variant = WanVariant.of(
            in_channels=transformer.config.in_channels,
            z_dim=vae.config.z_dim,
            temporal_stride=vae.config.scale_factor_temporal,
            expand_timesteps=expand_timesteps,
            image_dim=transformer.config.image_dim,
            boundary_ratio=boundary_ratio,
            control=isinstance(transformer, WanVACEDiT),
        )
        # The LoRAs on the experts now: each call states its own; unchanged sets are kept applied.
        self.loras = LoRASlot()

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype = torch.float32,
        offload: str | None = None,
        gpu_memory_gb: float | None = None,
        load_on_host: bool | None = None,
        parallel: ParallelConfig | ParallelLayout | None = None,
        torch_dtype: torch.dtype | str | None = None,
    ) -> WanT2VPipeline:
        """Load a local diffusers-format Wan directory; DiT and text encoder in `dtype`, the VAE in `vae_dtype`.

        offload ('none' | 'model' | 'layer') / gpu_memory_gb: the default memory policy of calls. With
        either set (other than 'none'), or load_on_host, the weights load into host memory and move
        to `device` as the first call's plan places them, so a model larger than the GPU never has
        to fit on it whole.
        parallel: a ParallelLayout (from mmgen.parallel.launch.run_parallel's workers), or a
        ParallelConfig resolved in this process (torch.distributed already initialized, or torchrun's
        environment); None = one process. Every rank holds the whole model (offload applies per rank)
        but the text encoder's weights: rank 0 encodes for all (mmgen.parallel.share.reads_for_world); with the
        weights on the device, the ranks split the text encoder's and the DiTs' reads and share them (SplitReads, share_reads).
        """
        dtype, vae_dtype = check_dtype(dtype, torch_dtype=torch_dtype), check_dtype(vae_dtype)
        device = check_device(device)  # dtype/device by any name; no CUDA is one line (pipelines.devices)
        layout = resolve_layout(parallel, torch.device(device).type)
        offload = None if offload is None else check_offload(offload)
        on_host = offload not in (None, "none") or check_budget(gpu_memory_gb) is not None
        on_host = on_host if load_on_host is None else load_on_host
        # Weights bound for offload are read straight into page-locked buffers (pinned only when the
        # device is a GPU; on the CPU the same buffers, unpinned): no second host copy to pin later.
        host = PinnedStore(register=torch.device(device).type == "cuda") if on_host else None
        # Over several ranks with the weights going to the device, each rank reads its part of the text
        # encoder and the DiTs (SplitReads: the pieces each takes as it is free, or a fixed split) and
        # gets the rest of what it keeps over the collective (NVLink), not from the host a second time.
        split = split_reads(layout, on_host, lambda: wan_read_bytes(Path(directory)))
        c = load_wan_components(
            Path(directory),
            dtype=dtype,
            device="cpu" if on_host else device,
            vae_dtype=vae_dtype,
            host=host,
            text_weights=reads_for_world(layout),
            reads=None if split is None else split.reads(),
        )
        layout = settled(layout)  # a rank's world joined while the weights loaded (launch.PendingLayout)
        if split is not None:
            modules = {
                "text_encoder": c.text_encoder,
                "transformer": c.transformer,
                "transformer_2": c.transformer_2,
            }
            share_reads(split, modules, layout)
        return cls(
            c.transformer,
            c.text_encoder,
            c.tokenizer,
            c.vae,
            c.scheduler,
            defaults=c.defaults,
            source=c.source,
            transformer_2=c.transformer_2,
            image_encoder=c.image_encoder,
            image_preprocess=c.image_preprocess,
            boundary_ratio=c.boundary_ratio,
            expand_timesteps=c.expand_timesteps,
            device=device,
            offload=offload,
            gpu_memory_gb=gpu_memory_gb,
            layout=layout,
            host=host,
        )

    @property
    def experts(self) -> tuple[WanDiT, ...]:
        """The transformers by StepPlan.expert: (transformer,) or (transformer, transformer_2)."""
        second = self.components.transformer_2
        return (self.transformer,) if second is None else (self.transformer, second)

    @property
    def defaults(self) -> GenerationDefaults:
        return self.components.defaults

    @property
    def has_own_placement(self) -> bool:
        """Whether the caller built this pipeline with its own placement (then offload is refused)."""
        return self._explicit_placement

    @property
    def spatial_multiple(self) -> int:
        """Heights and widths must be multiples of this: 16, and of VAE scale x DiT patch (16 for Wan)."""
        scale = self.vae.config.scale_factor_spatial
        _, patch_h, patch_w = self.transformer.config.patch_size
        return math.lcm(16, scale * patch_h, scale * patch_w)

    @property
    def temporal_stride(self) -> int:
        return self.vae.config.scale_factor_temporal

    @property
    def capabilities(self) -> Capabilities:
        """What this checkpoint does (its variant's tasks; what the faces and the server report)."""
        return self.variant.capabilities("video" if self.makes_video else "image")

    def latents_shape(
        self, height: int, width: int, num_frames: int, references: int = 0
    ) -> tuple[int, int, int, int, int]:
        """[1, z_dim, R + (F - 1) // 4 + 1, H // 8, W // 8] for Wan's VAE; R: VACE's reference images."""
        spatial = self.vae.config.scale_factor_spatial
        frames = references + (num_frames - 1) // self.temporal_stride + 1
        return (1, self.vae.config.z_dim, frames, height // spatial, width // spatial)

    def arrange(self, plan: GenerationPlan) -> Placement:
        """Make the weights ready for `plan` and return the Placement the loop gets.

        Blocks compiled once when a plan first asks (WanDiT.compile_blocks); cached FP8 weight copies
        (at most one per FP8-capable layer: a copy is re-made only when its weight changes) dropped
        when a plan without FP8 runs under a memory budget (its estimate does not count them), when
        compiling re-stacks q/k/v or when the weights move; the weights placed for
        plan.memory.offload, moved only when that differs from the last call's.
        """
        if plan.request.compile and not all(expert.blocks_compiled for expert in self.experts):
            # Stacking q/k/v makes new weight storages: offloaded weights are re-placed after it.
            if isinstance(self.placement, OffloadPlacement) and self.placement.offload != "none":
                self.placement.release(to=torch.device("cpu"))
                self.placement = ResidentPlacement()
            for expert in self.experts:
                if not expert.blocks_compiled:
                    expert.compile_blocks().release_fp8_weights()  # the stacked q/k/v: new storages
        memory = plan.memory
        if not plan.fp8.linear_layers and memory.budget_gib is not None:
            for expert in self.experts:
                expert.release_fp8_weights()
        if self._explicit_placement:
            return self.placement
        current = self.placement
        wanted = (memory.offload, memory.prefetch_experts)
        if isinstance(current, OffloadPlacement) and (current.offload, current.prefetch_experts) == wanted:
            return current
        if isinstance(current, OffloadPlacement):
            current.release()
        for expert in self.experts:
            expert.release_fp8_weights()
        self.placement = OffloadPlacement(
            memory.offload,
            experts=self.experts,
            text_encoder=self.components.text_encoder if reads_for_world(self.layout) else None,
            vae=self.vae,
            device=self.device,
            prefetch_experts=memory.prefetch_experts,
            host=self._host,
        )
        self._host = None  # closed by the placement: later placements copy into fresh buffers
        return self.placement

    def encode_text(
        self, prompts: list[str], max_length: int, block_stream: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (UMT5 embeddings [B, max_length, d] in the DiT dtype, token counts [B]); pipelines.conditioning."""
        return encode_text(self, prompts, max_length, block_stream)

    def conditioning(
        self, text: torch.Tensor, text_lens: torch.Tensor, image: ImageParts | None = None
    ) -> Conditioning:
        """Text [1 or 2, L, d] and its token counts (+ image parts) -> the loop's Conditioning (metadata built once)."""
        return build_conditioning(self, text, text_lens, image)
