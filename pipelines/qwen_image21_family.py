"""Qwen-Image-2.1 on the one prepare -> run -> record: its hooks (pipelines.family.FamilyHooks) and the
pipeline class on pipelines.pipeline.Pipeline.

The pieces are pipelines.qwen_image21's functions (each checked against diffusers' QwenImage21Pipeline
there); this file only wires them into the shared steps:

- encode_text returns the family's text value, a PromptBatch (text, lengths and the image-slot masks
  the block-causal layout needs), and reads the request's condition image itself: Qwen3-VL's vision
  tower sees it inside the prompt;
- conditioning builds one BlockCausalLayout per branch (cond and uncond of one request are samples of
  one packed layout, so batched CFG is one call) and the request's prefix K/V caches, one per branch,
  empty; the call hook fills a branch's cache at its first step and reads it after; on CUDA (weights
  resident) a branch's cached steps repeat one call, so from its second cached step on the call is
  replayed as CUDA graphs (mmgen.models.step_graph: the same kernels, the same bits, no host launches);
- guide is plain CFG (no norm rescale, unlike Qwen-Image 1.0);
- decode: the VAE makes four channels, so frames are RGBA uint8 [T, H, W, 4];
- the pipeline takes offload 'model' / 'layer' (mmgen.placement), LoRAs (read_qwen_image21_lora) and a
  parallel layout: CFG parallel runs each branch (its layout, its cache) on its rank, Ulysses gives
  the layout to the model call.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.loading.defaults import GenerationDefaults
from mmgen.loading.qwen_image21_dir import load_qwen_image21_components, qwen_image21_read_bytes
from mmgen.lora import LoRAFile, LoRASlot, read_lora_file
from mmgen.lora.qwen_image import parse_qwen_image_lora
from mmgen.models.qwen_image21 import PrefixCache
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from mmgen.models.step_graph import KeptGraph, StepGraphs
from mmgen.parallel.collective import Collective, run_now
from mmgen.parallel.launch import resolve_layout, settled
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.parallel.packed_rows import PackedUlysses
from mmgen.parallel.share import reads_for_world, share_reads, split_reads
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.policy import MemoryPlan, check_offload
from mmgen.placement.tensors import PinnedStore
from pipelines.checks import check_size, image_load_refusals, offload_refusals
from pipelines.common import video_to_uint8
from pipelines.denoise import BranchedConditioning, plan_steps
from pipelines.devices import check_device, check_dtype
from pipelines.family import Decisions
from pipelines.pipeline import Pipeline
from pipelines.qwen_image21 import (
    DEFAULT_RESOLUTION,
    DEFAULT_STEPS,
    SIZE_MULTIPLE,
    VAE_SCALE,
    PromptBatch,
    condition_latents,
    condition_size,
    encode_prompts,
    initial_noise,
    make_schedule,
    prepare_condition,
    vae_latent_stats,
)
from pipelines.qwen_image21_capabilities import CAPABILITIES, PIPELINE_CLASS
from pipelines.qwen_image21_graphs import replayed_call, request_graphs, step_graphs

# diffusers' QwenImage21Pipeline defaults: 40 steps, CFG-distilled (guidance 1.0, no negative prompt).
DEFAULTS = GenerationDefaults(
    height=DEFAULT_RESOLUTION,
    width=DEFAULT_RESOLUTION,
    num_frames=1,
    num_inference_steps=DEFAULT_STEPS,
    guidance_scale=1.0,
    negative_prompt=None,
    fps=1,
    chosen_by="diffusers' QwenImage21Pipeline defaults",
)
ATTENTION_SITES = ("transformer.attn",)


@dataclass(frozen=True)
class Branch21:
    """One or more prompts as samples of one packed block-causal call; `key` names its prefix cache."""

    text: torch.Tensor  # [B, L, D]
    layout: BlockCausalLayout
    key: str

    @property
    def batch(self) -> int:
        return self.layout.batch


@dataclass(frozen=True)
class QwenImage21Conditioning(BranchedConditioning):
    """The request's own state: its branches, the condition tokens, and the prefix caches (one per
    branch key, filled by that branch's first call; None with the cache off)."""

    both: Branch21
    halves: tuple[Branch21, ...]
    condition: torch.Tensor | None  # [1, Nc, C] the condition images' tokens, shared by every sample
    caches: dict[str, PrefixCache] | None = field(default=None)
    graphs: StepGraphs | None = field(default=None)  # the cached steps' CUDA graphs (None: eager)
    # the request's part of a kept graph's signature (the LoRAs applied: the weights and modules it reads)
    signature: tuple = ()


class QwenImage21Hooks:
    """Qwen-Image-2.1's hooks; stateless."""

    title = "Qwen-Image-2.1"

    def resolve(self, pipeline: Any, request: Any, *, seeded: bool) -> tuple[Any, str | None]:
        """Refusals, then the defaults (the size from the last condition image when it has any), a seed,
        the multiple-of-32 check (refused, never rounded)."""
        refused = pipeline.capabilities.refusals(request, self.title)
        if request.num_frames not in (None, 1):
            refused.append(f"num_frames = {request.num_frames}: {self.title} makes one image (1 frame)")
        refused += offload_refusals(pipeline.offload, request)
        if refused:
            raise ValidationError("; ".join(refused))
        filled = {k: v for k, v in pipeline.defaults.request_values().items() if getattr(request, k) is None}
        # diffusers' output_resolution: the condition images' area and, without height/width, the output's
        area = request.output_resolution or pipeline.condition_resolution
        filled["output_resolution"] = area
        width, height, size_rule = area, area, None
        if request.images and (request.height is None or request.width is None):
            last = request.images[-1]
            width, height = condition_size(area, last.width, last.height)
            size_rule = f"the (last) image's aspect ratio at {area}x{area} pixels, sides / 32"
        filled.update(
            {k: v for k, v in (("height", height), ("width", width)) if getattr(request, k) is None}
        )
        if request.seed is None and seeded:
            filled["seed"] = secrets.randbits(63)
        request = request.with_values(**filled) if filled else request
        for name in ("height", "width"):  # diffusers' 2x2 slots over 16x latents: refused, never rounded
            check_size(name, getattr(request, name), SIZE_MULTIPLE)
        return request, size_rule

    def decide(self, pipeline: Any, request: Any, lossy: Any, attention: Any) -> Decisions:
        return Decisions(memory=MemoryPlan(offload=pipeline.offload, cfg=request.cfg or "batch"))

    def scheduler(self, pipeline: Any, request: Any) -> Any:
        """A fresh FlowMatch Euler with the directory's sample sigmas (or linspace) and the token shift."""
        scheduler = type(pipeline.components.scheduler).from_config(pipeline.components.scheduler.config)
        tokens = (request.height // VAE_SCALE) * (request.width // VAE_SCALE)
        make_schedule(scheduler, tokens, request.num_inference_steps, pipeline.components.sample_sigmas)
        return scheduler

    def steps(self, pipeline: Any, request: Any, scheduler: Any) -> tuple[Any, ...]:
        return plan_steps(scheduler.timesteps, (request.guidance_scale,))

    def initial_latents(self, pipeline: Any, plan: Any, generator: Any, latents: Any) -> torch.Tensor:
        """Packed [1, N, C] in the model dtype, drawn as diffusers draws it; given latents: that shape."""
        request = plan.request
        channels = pipeline.transformer.config.in_channels
        shape = (1, (request.height // VAE_SCALE) * (request.width // VAE_SCALE), channels)
        if latents is not None:
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != shape:
                got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
                raise ValidationError(f"latents: expected {shape} (packed) for this request, got {got}")
            return latents.to(pipeline.device, pipeline.dtype)
        if generator is None:
            generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = initial_noise(1, channels, request.height, request.width, generator, pipeline.dtype)
        return noise.to(pipeline.device)

    def encode_text(self, pipeline: Any, plan: Any, prompts: list[str], text_stream: Any) -> Any:
        """prompts -> (PromptBatch: text, lengths, image-slot masks; text_lens int64). The condition
        image goes into the text encoder with each prompt (alpha over white, resized as the VAE's)."""
        images = [
            prepare_condition(image, plan.request.output_resolution)[0] for image in condition_images(plan)
        ]
        components = pipeline.components
        # Prompt and negative prompt in separate encoder calls, as diffusers (left padding is per call).
        encoder, processor = components.text_encoder, components.processor
        batch = PromptBatch.stack(
            [row for p in prompts for row in encode_prompts(encoder, processor, [p], images)]
        )
        return batch, torch.tensor(batch.text_lens, dtype=torch.int64)

    def encode_condition(self, pipeline: Any, plan: Any, stage: Any) -> torch.Tensor | None:
        """The condition images' latent tokens [1, Nc, C] (VAE mode, normalized), or None."""
        images = condition_images(plan)
        if not images:
            return None
        with stage("image_encode", "image_encode"), pipeline.placement.using("vae"):
            pixels = [prepare_condition(image, plan.request.output_resolution)[1] for image in images]
            return condition_latents(pipeline.vae, pixels, pipeline.dtype).to(pipeline.device)

    def conditioning(
        self, pipeline: Any, plan: Any, text: PromptBatch, text_lens: Any, condition: Any, latents: Any
    ) -> QwenImage21Conditioning:
        """One layout for all prompts (both) and one per prompt (halves, guided); empty prefix caches."""
        request, device = plan.request, pipeline.device
        grids = []
        if condition is not None:
            for image in condition_images(plan):
                width, height = condition_size(request.output_resolution, *image.size)
                grids.append((1, height // VAE_SCALE, width // VAE_SCALE))
        grids.append((1, request.height // VAE_SCALE, request.width // VAE_SCALE))

        def branch(batch: PromptBatch, key: str) -> Branch21:
            layout = BlockCausalLayout.build(
                batch.text_lens,
                grids,
                text_width=batch.text.shape[1],
                slot_masks=batch.slot_masks,
                device=device,
            )
            return Branch21(batch.text.to(device, pipeline.dtype), layout, key)

        halves = ()
        if len(text.text_lens) == 2:
            halves = tuple(
                branch(
                    PromptBatch(text.text[r : r + 1, :n], (n,), text.slot_masks[r : r + 1, :n]), f"half{r}"
                )
                for r, n in enumerate(text.text_lens)
            )
        cached = prefix_cached(pipeline, request)
        both = branch(text, "both")
        graphs, request_part = request_graphs(pipeline, cached, (both, *halves))
        return QwenImage21Conditioning(both, halves, condition, {} if cached else None, graphs, request_part)

    def call(self, model: Any, x: Any, step: Any, branch: Branch21, conditioning: Any, models: Any) -> Any:
        """One packed call; a branch's first call (its cache empty) is the prefill that fills it, the
        later ones send the noise tokens alone against the cached prefix. Under CFG parallel each rank
        calls its own branch (its own layout and cache key); under Ulysses the call gets the layout and
        each rank's cache holds its heads (QwenImage21Transformer.forward)."""
        cache = None
        if conditioning.caches is not None:
            cache = conditioning.caches.setdefault(branch.key, PrefixCache())
        cached = cache is not None and cache.filled
        samples = branch.batch
        tokens = x.expand(samples, -1, -1)
        if conditioning.condition is not None and not cached:
            tokens = torch.cat([conditioning.condition.expand(samples, -1, -1).to(x.dtype), tokens], dim=1)
        timestep = step.timestep.expand(samples).to(x.device, x.dtype) / 1000

        def forward(
            tokens: torch.Tensor, timestep: torch.Tensor, collective: Collective = run_now
        ) -> torch.Tensor:
            return model(
                tokens,
                timestep,
                None if cached else branch.text,
                metadata=branch.layout,
                attention=models.attention,
                cache=cache,
                parallel=models.layout if models.layout.sp_degree > 1 else None,
                settings=models.settings,
                collective=collective,
            )

        if cached and conditioning.graphs is not None:
            return replayed_call(
                conditioning.graphs, branch, conditioning.signature, models, forward, cache, tokens, timestep
            )
        return forward(tokens, timestep)

    def guide(self, outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
        """Plain CFG, diffusers' QwenImage21Pipeline (no norm rescale)."""
        return outputs[0] if len(outputs) == 1 else outputs[1] + scale * (outputs[0] - outputs[1])

    def unpack(self, pipeline: Any, plan: Any, latents: torch.Tensor) -> torch.Tensor:
        """[1, N, C] -> [1, C, 1, H/16, W/16]."""
        request = plan.request
        channels = latents.shape[-1]
        grid = (request.height // VAE_SCALE, request.width // VAE_SCALE)
        return latents.transpose(1, 2).reshape(1, channels, 1, *grid)

    def attention_providers(self, pipeline: Any, plan: Any) -> dict[str, str]:
        return dict.fromkeys(ATTENTION_SITES, f"{plan.attention.name}:{plan.attention.provider}")

    def recorded_args(self, pipeline: Any, plan: Any, output: Any) -> dict[str, Any]:
        cached = prefix_cached(pipeline, plan.request)
        return {
            "variant": "edit" if plan.request.images else "t2i",
            **plan.request.record(),
            "guided": plan.guided,
            "prefix_kv_cache": bool(cached),
            "cuda_graphs": bool(cached and step_graphs(pipeline)),
            "channels": 4,  # RGBA frames
        }


def read_qwen_image21_lora(path: Path | str) -> LoRAFile:
    """A Qwen-Image-2.1 LoRA file in the layouts diffusers' QwenImage21Pipeline loads: its LoRA loader is
    Qwen-Image's (QwenImageLoraLoaderMixin), and 2.1's parameter names are diffusers', so Qwen-Image's
    reader names 2.1's modules as they are (diffusers/PEFT, ComfyUI, bare names; kohya's flat names
    only where they are Qwen-Image's: 2.1's own, such as img_mlp_gate_layer, are unknown keys, refused
    unless unmatched keys are allowed, as diffusers' conversion does not map them either)."""
    return read_lora_file(path, parse=parse_qwen_image_lora)


def condition_images(plan: Any) -> list[Any]:
    """The request's condition images as PIL RGBA, in order (prepare_condition composites the alpha over
    white for the text encoder and gives the VAE all four channels)."""
    return [image.pil("RGBA") for image in plan.request.images]


def prefix_cached(pipeline: Any, request: Any) -> bool:
    """Whether the text and condition K/V are cached after the first step: the model's prefix is
    modulated at t = 0 (causal_condition; otherwise it changes every step and there is nothing to
    keep) and the request did not turn the cache off."""
    return not request.no_prefix_cache and bool(pipeline.transformer.config.causal_condition)


class QwenImage21FamilyPipeline(Pipeline):
    """Qwen-Image-2.1: `pipe(prompt, **request fields)` or `pipe.generate(request)` -> a GenerationResult
    whose frames are RGBA uint8 [1, H, W, 4]."""

    directory_class = PIPELINE_CLASS
    capabilities = CAPABILITIES
    hooks = QwenImage21Hooks()
    spatial_multiple = SIZE_MULTIPLE

    def __init__(
        self,
        components: Any,
        *,
        device: str | torch.device | None = None,
        condition_resolution: int = DEFAULT_RESOLUTION,
        offload: str | None = None,
        host: PinnedStore | None = None,
        layout: ParallelLayout | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """offload: 'none' (default), 'model' or 'layer', where the weights live (mmgen.placement:
        'layer' streams the transformer's blocks; the Qwen3-VL text encoder and the VAE move whole);
        host: the PinnedStore the weights were loaded into (adopted by the placement). layout: this
        rank's ParallelLayout (Ulysses and/or CFG parallel; no ring), default one process. cuda_graphs:
        replay the cached steps as CUDA graphs where they apply (step_graphs); False: every step eager.
        The last request's graphs stay between requests with what they read (their memory pool and
        prefix cache: a few GiB at 1024x1024, RESULTS.md 20e's peaks), dropped by a request of other
        shapes before its prefill."""
        self.cuda_graphs = cuda_graphs
        # The cached steps' CUDA graphs kept from the last request, one per branch key, for the next
        # request of the same signature (mmgen.models.step_graph.KeptGraph): no warm-up step, no capture.
        self.kept_graphs: dict[str, KeptGraph] = {}
        # The default of the request's output_resolution (diffusers'): condition images are resized to
        # about this many pixels squared, and the output size follows the last one when not given.
        self.condition_resolution = condition_resolution
        self.components = (
            components  # transformer, text_encoder, processor, vae, scheduler, sample_sigmas, source
        )
        self.layout = ParallelLayout.single() if layout is None else layout
        transformer = components.transformer
        if self.layout.sp_degree > 1:
            # Before any work: Ulysses splits the heads, and the segment attention runs no ring.
            PackedUlysses.plan(1, transformer.config.num_attention_heads, self.layout)
        self.loras = LoRASlot(reader=read_qwen_image21_lora)
        self._device = next(transformer.parameters()).device if device is None else torch.device(device)
        self.offload = check_offload("none" if offload is None else offload)
        self.placement = OffloadPlacement(
            self.offload,
            experts=(transformer,),
            text_encoder=components.text_encoder,
            vae=components.vae,
            device=self._device,
            host=host,
        )

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
        parallel: ParallelConfig | ParallelLayout | None = None,
    ) -> QwenImage21FamilyPipeline:
        """A local diffusers-format Qwen-Image-2.1 directory; transformer and text encoder in `dtype`
        (default float32), the VAE in `vae_dtype`. offload: 'none', 'model' or 'layer' (the weights load
        into host memory and are copied to `device` while they run). parallel: a ParallelLayout (from
        mmgen.parallel.launch.run_parallel's workers) or a ParallelConfig resolved in this process;
        rank 0 alone encodes text and (without offload) the others split the transformer's reads (as Wan's)."""
        dtype, vae_dtype = check_dtype(dtype), check_dtype(vae_dtype)
        device = check_device(device)
        layout = resolve_layout(parallel, torch.device(device).type)
        offload = "none" if offload is None else check_offload(offload)
        host = None if offload == "none" else PinnedStore(register=torch.device(device).type == "cuda")
        # the transformer's reads split over ranks 1 ... N - 1 (rank 0 reads the encoder whole: transformers')
        split = split_reads(layout, host is not None, lambda: qwen_image21_read_bytes(Path(directory)))
        parts = load_qwen_image21_components(
            directory,
            dtype=dtype,
            device=device if host is None else "cpu",
            vae_dtype=vae_dtype,
            host=host,
            text_weights=reads_for_world(layout),
            reads=None if split is None else split.reads(),
        )
        layout = settled(layout)  # a rank's world joined while the weights loaded (launch.PendingLayout)
        if split is not None:
            share_reads(split, {"transformer": parts.transformer}, layout)
        return cls(parts, device=device, offload=offload, host=host, layout=layout)

    @property
    def defaults(self) -> GenerationDefaults:
        return DEFAULTS

    @property
    def makes_video(self) -> bool:
        return False

    def arrange(self, plan: Any) -> OffloadPlacement:
        """The placement chosen at load (a request cannot change it)."""
        return self.placement

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, mode: str = "full") -> Any:
        """[1, C, 1, h, w] -> RGBA uint8 [1, H, W, 4], as diffusers' QwenImage21Pipeline decodes
        (latents * std + mean in the VAE dtype; no tiled or split decode)."""
        if mode != "full":
            raise ValidationError(f"decode mode {mode!r}: {QwenImage21Hooks.title} decodes whole ('full')")
        vae = self.vae
        z = latents.to(next(vae.parameters()).device, vae.dtype)
        mean, std = vae_latent_stats(vae, z)
        return video_to_uint8(vae.decode(z * std + mean, return_dict=False)[0])


def load_qwen_image21_pipeline(
    directory: Path,
    *,
    task: str,
    device: str,
    dtype: str,
    offload: str | None = None,
    gpu_memory_gb: float | None = None,
    load_on_host: bool | None = None,
    parallel: Any = None,
) -> QwenImage21FamilyPipeline:
    """The registry's loader (mmgen.families.family.Loader) for a Qwen-Image-2.1 directory: images
    (task 't2i'; an edit is a t2i request with an image); offload ('model' / 'layer') chosen here, at
    load; parallel: Ulysses and/or CFG parallel. A GPU budget is refused before any weight loads."""
    refused = image_load_refusals(QwenImage21Hooks.title, directory, task, gpu_memory_gb, load_on_host)
    if refused:
        raise ValidationError("; ".join(refused))
    return QwenImage21FamilyPipeline.from_pretrained(
        directory, dtype=dtype, device=device, offload=offload, parallel=parallel
    )
