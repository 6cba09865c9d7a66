"""Wan video generation: prompt (+ image) -> UMT5 text -> seeded noise -> DiT denoise loop -> VAE -> frames.

One pipeline for every Wan variant (pipelines.wan_variant): Wan2.1 T2V / I2V, Wan2.2 T2V-A14B and
I2V-A14B (two experts) and TI2V-5B. The variant is read once from the components; it decides what
the request's Conditioning holds and which expert each step runs (pipelines.denoise).

Numerically this is diffusers' WanPipeline / WanImageToVideoPipeline (same text handling, image
preprocessing, noise, scheduler calls, guidance formula, latent denormalization and uint8
conversion); it differs in how work is organized: the
request is validated before any work, cond and uncond run as one batch-2 DiT call, the attention
impl and its metadata are values passed to the model, and the result carries hashes, timings and
the environment fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.attention import select_attention
from mmgen.attention.fp8 import FP8_HEAD_DIMS, check_fp8_attention_impl
from mmgen.attention.metadata import DiTAttention
from mmgen.errors import ValidationError
from mmgen.fingerprint import environment_fingerprint
from mmgen.layers.fp8_linear import (
    FP8_LAYERS_BY_WIDTH,
    check_fp8_device,
    fp8_gemm_supported,
    fp8_layers_for,
)
from mmgen.loading.diffusers_dir import load_wan_components
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.loading.wan_components import (
    WAN21_T2V_DEFAULTS,
    GenerationDefaults,
    WanComponents,
    check_compatible,
)
from mmgen.lora import LoRASlot, coerce_requests
from mmgen.lora.request import check_mode
from mmgen.models.clip_vision import ClipImagePreprocess, ClipVisionEncoder
from mmgen.models.umt5 import TextPadding, UMT5Encoder
from mmgen.models.wan import WanDiT
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from mmgen.parallel.attention import self_attention_provider
from mmgen.parallel.launch import resolve_layout
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.parallel.vae_decode import split_decode
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.peaks import StagePeaks
from mmgen.placement.policy import GIB, MemoryPlan, check_budget, check_offload
from mmgen.placement.tensors import PinnedStore
from mmgen.progress import ProgressReporter, as_reporter
from pipelines.common import (
    GenerationResult,
    check_attention_backend,
    check_guidance,
    check_num_frames,
    check_seed,
    check_size,
    check_steps,
    clean_prompt,
    video_to_uint8,
)
from pipelines.denoise import (
    Conditioning,
    DenoiseModels,
    DenoiseOptions,
    Placement,
    ResidentPlacement,
    TextBranch,
    denoise,
    plan_steps,
    split_branches,
)
from pipelines.devices import check_device, check_dtype
from pipelines.image_input import ImageInput, read_image, size_for_image, vae_pixels
from pipelines.memory import decode_latents, fp8_copy_bytes, model_sizes, resolve_plan, workload
from pipelines.presets import PRESETS, check_preset, preset_value
from pipelines.step_cache import ACCEL_PRESETS, resolve_accel
from pipelines.wan_variant import WanVariant

# The DiT sites that run the selected attention impl (the text encoder has its own dense attention).
ATTENTION_SITES = ("transformer.self_attn", "transformer.cross_attn")


@dataclass(frozen=True)
class _Request:
    """The resolved, validated arguments of one call."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int | None
    attention_backend: str
    max_sequence_length: int
    compile: bool
    guidance_scale_2: float | None = None  # the second expert's (Wan2.2 A14B); None with one expert
    image: ImageInput | None = None
    size_rule: str | None = None  # how height/width were derived from the image, when they were
    preset: str | None = None  # a pipelines.presets name: fixes steps, guidance and the scheduler
    # lossy accelerations (pipelines.step_cache), None = off; accel names the preset that set them
    step_cache: float | None = None
    cfg_truncation: float | None = None
    accel: str | None = None
    fp8_linear: bool | None = None  # FP8 linear layers (mmgen.layers.fp8_linear), None = off
    fp8_attention: bool | None = None  # FP8 self-attention (mmgen.attention.fp8), None = off

    @property
    def guided(self) -> bool:
        # diffusers' rule: classifier-free guidance only when the scale exceeds 1.
        return self.guidance_scale > 1.0


# Request fields in result.args only when set: the args of a lossless call stay what they were.
_LOSSY_FIELDS = ("step_cache", "cfg_truncation", "accel", "fp8_linear", "fp8_attention")


@dataclass(frozen=True)
class ImageParts:
    """What an image adds to a request's Conditioning (see pipelines.denoise.Conditioning).

    concat [1, mask + z_dim, F', H', W'] (I2V); first_frame [1, z_dim, 1, H', W'] with
    first_frame_mask [1, 1, F', H', W'] (TI2V); image_embeds [1, N, image_dim] (Wan2.1 I2V).
    """

    concat: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None
    first_frame_mask: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


class WanT2VPipeline:
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
        environment); None = one process. Every rank loads the whole model (offload applies per rank).
        """
        dtype, vae_dtype = check_dtype(dtype, torch_dtype=torch_dtype), check_dtype(vae_dtype)
        device = check_device(device)  # dtype/device by any name; no CUDA is one line (pipelines.loader)
        layout = resolve_layout(parallel, torch.device(device).type)
        offload = None if offload is None else check_offload(offload)
        on_host = offload not in (None, "none") or check_budget(gpu_memory_gb) is not None
        on_host = on_host if load_on_host is None else load_on_host
        # Weights bound for offload are read straight into page-locked buffers (pinned only when the
        # device is a GPU; on the CPU the same buffers, unpinned): no second host copy to pin later.
        host = PinnedStore(register=torch.device(device).type == "cuda") if on_host else None
        c = load_wan_components(
            Path(directory), dtype=dtype, device="cpu" if on_host else device, vae_dtype=vae_dtype, host=host
        )
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
    def transformer(self) -> WanDiT:
        return self.components.transformer

    @property
    def vae(self) -> Any:
        return self.components.vae

    @property
    def experts(self) -> tuple[WanDiT, ...]:
        """The transformers by StepPlan.expert: (transformer,) or (transformer, transformer_2)."""
        second = self.components.transformer_2
        return (self.transformer,) if second is None else (self.transformer, second)

    @property
    def defaults(self) -> GenerationDefaults:
        return self.components.defaults

    @property
    def device(self) -> torch.device:
        """Where the DiT computes."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def spatial_multiple(self) -> int:
        """Heights and widths must be multiples of this: 16, and of VAE scale x DiT patch (16 for Wan)."""
        scale = self.vae.config.scale_factor_spatial
        _, patch_h, patch_w = self.transformer.config.patch_size
        return math.lcm(16, scale * patch_h, scale * patch_w)

    @property
    def temporal_stride(self) -> int:
        return self.vae.config.scale_factor_temporal

    def attention_for(self, backend: str) -> Any:
        """The attention impl `backend` ('auto', 'flash', 'sdpa', ...) resolves to for this model."""
        return select_attention(
            backend, device=self.device, dtype=self.dtype, head_dim=self.transformer.config.attention_head_dim
        )

    def latents_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int, int, int]:
        """[1, z_dim, (F - 1) // 4 + 1, H // 8, W // 8] for Wan's VAE."""
        spatial = self.vae.config.scale_factor_spatial
        frames = (num_frames - 1) // self.temporal_stride + 1
        return (1, self.vae.config.z_dim, frames, height // spatial, width // spatial)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        attention_backend: str = "auto",
        latents: torch.Tensor | None = None,
        max_sequence_length: int | None = None,
        progress: bool | ProgressReporter = True,
        prompt_enhancer: Callable[[str], str] | None = None,
        compile: bool = False,
        image: Any = None,
        guidance_scale_2: float | None = None,
        offload: str | None = None,
        gpu_memory_gb: float | None = None,
        cfg: str | None = None,
        ffn_chunk: int | None = None,
        decode: str | None = None,
        block_chunk: int | None = None,
        lora: Any = None,
        lora_mode: str = "fused",
        lora_allow_unmatched: bool = False,
        preset: str | None = None,
        step_cache: float | None = None,
        cfg_truncation: float | None = None,
        accel: str | None = None,
        fp8_linear: bool | None = None,
        fp8_attention: bool | None = None,
    ) -> GenerationResult:
        """Generate uint8 frames [T, H, W, 3]; arguments left None take the model directory's defaults.

        Noise: `latents` if given (float [1, z_dim, F', H/8, W/8]), else drawn on the CPU from
        `generator` or from a generator seeded with `seed` (a fresh random seed, recorded in
        result.args, when both are None), so the same seed gives the same noise on any device.
        `progress`: True (a tqdm bar), False, or a ProgressReporter the caller keeps driving after.
        `compile`: compile the DiT's blocks (WanDiT.compile_blocks, which also stacks the q/k/v
        projections) once, on the first call that asks; later calls reuse them. The first compiled
        step takes longer; results stay within bf16 rounding of an uncompiled run.
        `image`: a path (PNG / JPEG / WebP) or uint8 [H, W, 3] array; required by I2V checkpoints,
        optional for TI2V, refused by T2V ones. Without height and width it sets them: its aspect
        ratio at the default area, each side floored to the spatial multiple (result.args says so).
        `guidance_scale_2`: the low-noise expert's guidance (Wan2.2 A14B; default guidance_scale).
        Memory (mmgen.placement; None = the pipeline's default): `offload` 'none' | 'model' | 'layer';
        `gpu_memory_gb` plans the least offloading that fits (a budget too small is an error before
        any work); `cfg` 'batch' | 'sequential', `ffn_chunk` / `block_chunk` (tokens), `decode` 'full' | 'frames' |
        'tiled' (lossy) override the plan. The plan is in result.args['memory_plan'], the measured
        peak per stage in result.memory.
        `lora`: None, a LoRA (path, 'PATH[:STRENGTH][@EXPERT]', mapping {path, strength, experts} or
        mmgen.lora.LoRARequest) or a list of them; `lora_mode` 'fused' (merged into the weights) or
        'unfused' (low-rank matmuls beside them); `lora_allow_unmatched` applies a LoRA some of whose
        keys match no weight (they are listed in the report) instead of refusing it. Each call
        states its LoRAs: a call without restores the base weights (bitwise). What was applied is
        result.args['loras'] and fingerprint['loras'].
        `preset`: a name from pipelines.presets.PRESETS (e.g. 'distill-4step' for 4-step distillation
        LoRAs): sets steps, guidance and scheduler; a conflicting explicit value is an error.
        Lossy accelerations (off by default; pipelines.step_cache says what each does): `step_cache`
        a threshold >= 0 (reuse a step's model outputs while the accumulated timestep-signal change
        stays below it; 0 is exact), `cfg_truncation` the fraction in (0, 1] of the steps that keep
        CFG (1.0 is exact); `accel` 'fast' | 'fastest' sets both and FP8 linears + attention, the FP8
        parts only where they run natively (else skipped: result.args['accel_skipped'] says why); an
        explicit conflicting value is an error. result.args records them and 'step_cache_reused' (the steps that reused the cache).
        `fp8_linear`: True runs the DiT's linear layers of the kinds fp8_linear.fp8_layers_for picks for its width
        in FP8 e4m3 (lossy; Ada/Hopper GPUs with a bf16 model, emulated elsewhere); result.args
        records it and 'fp8_linear_layers'. Each call states it: a call without runs bf16.
        `fp8_attention`: True runs the DiT's self-attention on e4m3 q/k/v through FA3's FP8 forward
        (lossy; needs backend 'flash' with the FA3 provider on CUDA, emulated elsewhere).
        """
        started = time.perf_counter()
        chosen = check_preset(preset)
        num_inference_steps = preset_value(chosen, "num_inference_steps", num_inference_steps)
        guidance_scale = preset_value(chosen, "guidance_scale", guidance_scale)
        request = self._resolve(
            prompt, negative_prompt, height, width, num_frames, num_inference_steps, guidance_scale,
            seed, generator, attention_backend, max_sequence_length, compile, image, guidance_scale_2,
        )  # fmt: skip
        lossy = resolve_accel(accel, step_cache, cfg_truncation, fp8_linear, fp8_attention)
        # Explicit FP8 linears are planned for (their weight copies stay on the device); a preset's
        # are optional: planned without, then skipped when the plan has no room for them.
        wanted_fp8 = fp8_layers_for(self.experts[0].config.dim) if lossy.fp8_linear else frozenset()
        planned_fp8 = frozenset() if "fp8_linear" in lossy.from_preset else wanted_fp8
        plan = self.memory_plan(
            request, offload, gpu_memory_gb, cfg, ffn_chunk, decode, block_chunk, fp8_layers=planned_fp8
        )
        attention = self.attention_for(request.attention_backend)
        # An accel preset's FP8 parts run only where they are native; elsewhere they are skipped
        # (recorded in args['accel_skipped']), so the preset's output there is unchanged.
        accel_skipped = {
            name: reason
            for name, reason in self._fp8_obstacles(plan, attention, wanted_fp8).items()
            if name in lossy.from_preset
        }
        fp8_linear = lossy.fp8_linear if "fp8_linear" not in accel_skipped else None
        fp8_attention = lossy.fp8_attention if "fp8_attention" not in accel_skipped else None
        if fp8_linear:
            check_fp8_device(self.device, self.dtype)
            if plan.offload != "none":
                # The FP8 weight copies are made and kept on the device the weights run on: an
                # offloading plan would re-quantize every block each step and hold the copies anyway.
                raise ValidationError(
                    f"fp8_linear with offload {plan.offload!r} is not supported; use offload 'none' "
                    "(or a larger gpu_memory_gb)"
                )
        if fp8_attention and not self.layout.is_single:
            raise ValidationError(
                "fp8_attention with several ranks per job is not supported; run it on one GPU"
            )
        request = dataclasses.replace(
            request,
            preset=preset,
            step_cache=lossy.step_cache,
            cfg_truncation=lossy.cfg_truncation,
            accel=accel,
            fp8_linear=fp8_linear,
            fp8_attention=fp8_attention,
        )
        loras = coerce_requests(lora)
        check_mode(lora_mode)
        if not isinstance(lora_allow_unmatched, bool):
            raise ValidationError(f"lora_allow_unmatched = {lora_allow_unmatched!r}: must be true or false")
        if request.fp8_attention:
            check_fp8_attention_impl(attention, self.device, self.transformer.config.attention_head_dim)
        noise = self._initial_latents(request, generator, latents)
        # Before any denoising: read, check and apply (or keep) the LoRAs; errors leave the base weights.
        lora_report = self.loras.use(
            self.experts, loras, mode=lora_mode, allow_unmatched=lora_allow_unmatched
        )
        if request.compile and not all(expert.blocks_compiled for expert in self.experts):
            # Stacking q/k/v makes new weight storages: offloaded weights are re-placed after it.
            if isinstance(self.placement, OffloadPlacement) and self.placement.offload != "none":
                self.placement.release(to=torch.device("cpu"))
                self.placement = ResidentPlacement()
            for expert in self.experts:
                if not expert.blocks_compiled:
                    expert.compile_blocks()
        placement = self._arrange(plan)
        # The kinds that pay at this width (fp8_linear.FP8_LAYERS_BY_WIDTH); the experts share one width.
        fp8_layers = wanted_fp8 if request.fp8_linear else None
        for expert in self.experts:  # every call states it, so a call without runs bf16 again
            expert.set_fp8_linear(fp8_layers)
            expert.set_fp8_attention(bool(request.fp8_attention))
        peaks = StagePeaks(self.device, release_cache=plan.budget_gib is not None)
        # Several ranks run this call together; only the one that owns outputs draws bars.
        reporter, owned = as_reporter(progress if self.layout.owns_outputs else False)
        timings: dict[str, float] = {}
        try:
            original_prompt = request.prompt
            if prompt_enhancer is not None:
                tick = time.perf_counter()
                enhanced = prompt_enhancer(request.prompt)
                if not isinstance(enhanced, str):
                    raise ValidationError(f"prompt_enhancer returned {type(enhanced).__name__}, expected str")
                request = dataclasses.replace(request, prompt=enhanced)
                timings["prompt_enhance"] = time.perf_counter() - tick

            tick = time.perf_counter()
            prompts = [request.prompt, request.negative_prompt] if request.guided else [request.prompt]
            with peaks.stage("text_encode"), self._using(placement, "text_encoder"):
                text, text_lens = self.encode_text(prompts, request.max_sequence_length)
            timings["text_encode"] = self._elapsed(tick)

            image_parts = None
            if request.image is not None:
                tick = time.perf_counter()
                image_parts = self.encode_image(request)
                timings["image_encode"] = self._elapsed(tick)

            tick = time.perf_counter()
            with peaks.stage("denoise"):
                conditioning = self.conditioning(text, text_lens, image_parts)
                options = DenoiseOptions(
                    cfg=plan.cfg, step_cache=request.step_cache, cfg_truncation=request.cfg_truncation
                )
                reused: list[int] = []
                final = self.denoise(
                    noise, conditioning, request, attention, reporter, options=options, reused=reused
                )
                if isinstance(placement, OffloadPlacement):
                    placement.park_all()
            timings["denoise"] = self._elapsed(tick)

            tick = time.perf_counter()
            reporter.stage("decode", 1)
            with peaks.stage("decode"), self._using(placement, "vae"):
                frames = self.decode(final, mode=plan.decode)
            reporter.advance()
            timings["decode"] = self._elapsed(tick)
        finally:
            if owned:
                reporter.close()
        timings["total"] = time.perf_counter() - started

        providers = dict.fromkeys(ATTENTION_SITES, f"{attention.name}:{attention.provider}")
        providers["transformer.self_attn"] = self_attention_provider(attention, self.layout)
        if request.fp8_attention:
            providers["transformer.self_attn"] += " e4m3"
        frames.flags.writeable = False
        final = final.detach().to("cpu", torch.float32)
        args = self._record(request, generator=generator, latents=latents)
        if prompt_enhancer is not None:
            args["prompt_original"] = original_prompt
        args["memory_plan"] = plan.record()
        fingerprint = environment_fingerprint(
            device=self.device, dtype=self.dtype, attention_providers=providers
        )
        if request.preset is not None:
            args["preset_settings"] = PRESETS[request.preset].to_json()
        if request.accel is not None:
            args["accel_settings"] = ACCEL_PRESETS[request.accel].to_json()
            if accel_skipped:
                args["accel_skipped"] = accel_skipped
        if request.step_cache is not None:
            args["step_cache_reused"] = reused
        if fp8_layers is not None:
            args["fp8_linear_layers"] = sorted(fp8_layers)
        if lora_report is not None:
            args["loras"] = lora_report.to_json()
            fingerprint["loras"] = lora_report.identity()
        return GenerationResult(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents=final,
            latents_sha256=tensor_sha256(final),
            timings=timings,
            fingerprint=fingerprint,
            attention_providers=providers,
            args=args,
            memory=dict(peaks.gib),
        )

    def _resolve(
        self,
        prompt: Any,
        negative_prompt: Any,
        height: Any,
        width: Any,
        num_frames: Any,
        steps: Any,
        guidance: Any,
        seed: Any,
        generator: Any,
        attention_backend: Any,
        max_sequence_length: Any,
        compile: Any,
        image: Any = None,
        guidance_scale_2: Any = None,
    ) -> _Request:
        """Fill defaults and validate everything before any work; errors name field, value and allowed."""
        d = self.defaults
        variant = self.variant
        if image is None and variant.requires_image:
            raise ValidationError(
                "this checkpoint is image-to-video (I2V): pass image= (a PNG/JPEG/WebP path or uint8 array)"
            )
        if image is not None and not variant.accepts_image:
            raise ValidationError(
                "image given, but this checkpoint is text-to-video only (no image conditioning)"
            )
        picture = None if image is None else read_image(image)
        if guidance_scale_2 is not None:
            if variant.experts == 1:
                raise ValidationError(
                    "guidance_scale_2 needs a two-expert checkpoint (Wan2.2 A14B: boundary_ratio)"
                )
            guidance_scale_2 = check_guidance(guidance_scale_2)
        size_rule = None
        if picture is not None and height is None and width is None:
            height, width, size_rule = size_for_image(picture, d.height * d.width, self.spatial_multiple)
        if not isinstance(prompt, str):
            raise ValidationError(f"prompt must be a string, got {type(prompt).__name__}")
        negative_prompt = d.negative_prompt if negative_prompt is None else negative_prompt
        if not isinstance(negative_prompt, str):
            raise ValidationError(
                f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}"
            )
        if seed is not None and generator is not None:
            raise ValidationError("pass either seed or generator, not both")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValidationError("generator must be a CPU torch.Generator (noise is drawn on the CPU)")
        max_len = self.transformer.config.text_len if max_sequence_length is None else max_sequence_length
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2:
            raise ValidationError(f"max_sequence_length = {max_len!r}: must be an integer >= 2")
        if not isinstance(compile, bool):
            raise ValidationError(f"compile = {compile!r}: must be true or false")
        num_frames = check_num_frames(
            d.num_frames if num_frames is None else num_frames, self.temporal_stride
        )
        patch_t = self.transformer.config.patch_size[0]
        if ((num_frames - 1) // self.temporal_stride + 1) % patch_t:
            raise ValidationError(
                f"num_frames = {num_frames}: its latent frame count must be a multiple of the patch size {patch_t}"
            )
        return _Request(
            prompt=prompt,
            negative_prompt=negative_prompt,
            height=check_size("height", d.height if height is None else height, self.spatial_multiple),
            width=check_size("width", d.width if width is None else width, self.spatial_multiple),
            num_frames=num_frames,
            num_inference_steps=check_steps(d.num_inference_steps if steps is None else steps),
            guidance_scale=check_guidance(d.guidance_scale if guidance is None else guidance),
            seed=check_seed(secrets.randbits(63) if seed is None and generator is None else seed),
            attention_backend=check_attention_backend(attention_backend),
            max_sequence_length=max_len,
            compile=compile,
            guidance_scale_2=None if variant.experts == 1 else guidance_scale_2,
            image=picture,
            size_rule=size_rule,
        )

    def _initial_latents(
        self, request: _Request, generator: torch.Generator | None, latents: torch.Tensor | None
    ) -> torch.Tensor:
        """float32 [1, z_dim, F', H/8, W/8] on the model's device: given, or standard normal from the CPU."""
        shape = self.latents_shape(request.height, request.width, request.num_frames)
        if latents is not None:
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != shape:
                got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
                raise ValidationError(f"latents: expected shape {shape} for this request, got {got}")
            return latents.to(device=self.device, dtype=torch.float32)
        if generator is None:
            generator = torch.Generator("cpu").manual_seed(request.seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)

    @torch.no_grad()
    def encode_text(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (UMT5 embeddings [B, max_length, d] in the DiT dtype, token counts int64 [B]).

        Wan's trained input: each prompt's own hidden states, then zeros up to max_length; the DiT
        attends to all of it densely (the counts matter only to a config with text_mask).
        """
        tokenizer, encoder = self.components.tokenizer, self.components.text_encoder
        ids, mask = tokenizer.encode([clean_prompt(p) for p in prompts], max_length)
        device = encoder.shared.weight.device
        padding = TextPadding.from_mask(mask.to(device))
        hidden = encoder(ids.to(device), padding)
        valid = padding.valid_mask(max_length).to(device)[..., None]
        hidden = torch.where(valid, hidden, torch.zeros((), dtype=hidden.dtype, device=device))
        return hidden.to(device=self.device, dtype=self.dtype), padding.lengths

    @torch.no_grad()
    def encode_image(self, request: _Request) -> ImageParts:
        """The request's image -> what it adds to the Conditioning, as diffusers' WanImageToVideoPipeline builds it."""
        image, variant = request.image, self.variant
        assert image is not None
        embeds = None
        if variant.image_embeddings:
            encoder = self.components.image_encoder
            pixels = self.components.image_preprocess(image.pil())
            device = encoder.embeddings.patch_embedding.weight.device
            embeds = encoder(pixels.to(device=device, dtype=encoder.dtype)).to(self.device, self.dtype)
        pixels = vae_pixels(image, request.height, request.width)[:, :, None]  # [1, 3, 1, H, W]
        _, z_dim, frames, height, width = self.latents_shape(
            request.height, request.width, request.num_frames
        )
        if variant.image_mode == "first_frame":
            latent = self._encode_condition(pixels)
            mask = torch.ones(1, 1, frames, height, width, device=self.device)
            mask[:, :, 0] = 0
            return ImageParts(first_frame=latent, first_frame_mask=mask, image_embeds=embeds)
        # I2V: the image, then black frames, encoded as one video; a mask marks the given frame.
        video = torch.cat([pixels, pixels.new_zeros(1, 3, request.num_frames - 1, *pixels.shape[3:])], dim=2)
        latent = self._encode_condition(video)
        stride = variant.mask_channels
        mask = torch.zeros(1, 1, request.num_frames + stride - 1, height, width, device=self.device)
        mask[:, :, :stride] = 1  # the first frame counts `stride` times: the VAE packs 4 frames per latent
        mask = mask.view(1, frames, stride, height, width).transpose(1, 2)
        return ImageParts(concat=torch.cat([mask, latent], dim=1), image_embeds=embeds)

    def _encode_condition(self, video: torch.Tensor) -> torch.Tensor:
        """float32 pixels [1, 3, T, H, W] in [-1, 1] -> normalized latents [1, z_dim, T', H', W'] (float32)."""
        vae = self.vae
        device = next(vae.parameters()).device
        latent = vae.encode(video.to(device=device, dtype=vae.dtype)).latent_dist.mode()
        latent = latent.to(self.device, torch.float32)
        mean, inv_std = self._latent_stats(latent.device, latent.dtype)
        return (latent - mean) * inv_std

    def _latent_stats(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent mean and 1 / std, each [1, z_dim, 1, 1, 1] on `device` in `dtype`.

        1 / std is taken in `dtype`, as diffusers does (decode divides by it: identical bits).
        """
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(device, dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(device, dtype)
        return mean, inv_std

    def conditioning(
        self, text: torch.Tensor, text_lens: torch.Tensor, image: ImageParts | None = None
    ) -> Conditioning:
        """Text [1 or 2 (cond, uncond), L, d] and its token counts [1 or 2] (+ image parts) -> the Conditioning.

        Metadata is a value built here once per request (the text never changes between steps): for
        the stacked branches and, when guided, for each branch alone (sequential / CFG-parallel steps).
        """
        masked = self.transformer.config.text_mask
        lens = text_lens.to(self.device)

        def metadata(rows: slice) -> DiTAttention:
            return self.transformer.build_attention_metadata(
                lens[rows] if masked else None, text_len=text.shape[1]
            )

        image = ImageParts() if image is None else image
        embeds = None if image.image_embeds is None else image.image_embeds.expand(text.shape[0], -1, -1)
        both = TextBranch(text=text, metadata=metadata(slice(None)), image_embeds=embeds)
        halves = split_branches(both, lambda row: metadata(slice(row, row + 1))) if text.shape[0] == 2 else ()
        return Conditioning(
            both=both,
            halves=halves,
            concat=image.concat,
            first_frame=image.first_frame,
            first_frame_mask=image.first_frame_mask,
        )

    @torch.no_grad()
    def denoise(
        self,
        latents: torch.Tensor,
        conditioning: Conditioning,
        request: _Request,
        attention: Any,
        progress: ProgressReporter,
        *,
        options: DenoiseOptions | None = None,
        reused: list[int] | None = None,
    ) -> torch.Tensor:
        """float32 latents [1, C, F', H', W'] -> final float32 latents, through pipelines.denoise."""
        if request.preset is not None:
            scheduler = PRESETS[request.preset].scheduler(self.device)
        else:
            scheduler = type(self.components.scheduler).from_config(self.components.scheduler.config)
            scheduler.set_timesteps(request.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        scales = (request.guidance_scale,)
        if self.variant.experts == 2:
            second = request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2
            scales = (request.guidance_scale, second)
        boundary = self.variant.boundary_timestep(scheduler.config.num_train_timesteps)
        steps = plan_steps(scheduler.timesteps, scales, boundary)
        models = DenoiseModels(
            experts=self.experts,
            attention=attention,
            layout=self.layout,
            placement=self.placement,
            dtype=self.dtype,
        )
        return denoise(
            latents,
            steps,
            scheduler,
            conditioning,
            models,
            options=DenoiseOptions() if options is None else options,
            progress=progress,
            synchronize=self._synchronize,
            reused=reused,
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, mode: str = "full") -> Any:
        """Final latents [1, z_dim, F', H', W'] -> uint8 frames [T, H, W, 3] (numpy), as diffusers decodes.

        mode: 'full' (diffusers' decode), 'frames' (the same, bit for bit, without the whole float
        video on the device) or 'tiled' (lossy); see pipelines.memory.decode_latents. 'split': each
        rank of the layout decodes a band of the frames (mmgen.parallel.vae_decode; exact up to conv
        rounding), gathered on every rank.
        """
        vae = self.vae
        device = next(vae.parameters()).device
        z = latents.to(device=device, dtype=vae.dtype)
        # diffusers divides by the reciprocal of std computed in the VAE dtype; kept for identical bits.
        mean, inv_std = self._latent_stats(device, z.dtype)
        if mode == "split":
            return split_decode(vae, z / inv_std + mean, self.layout, video_to_uint8)
        return decode_latents(vae, z / inv_std + mean, mode)

    def _fp8_obstacles(
        self, plan: Any, attention: Any, fp8_layers: frozenset[str] = frozenset()
    ) -> dict[str, str]:
        """Why fp8_linear / fp8_attention would not run natively in this call ({} when both would).

        Native: a CUDA GPU with FP8 GEMMs (compute capability >= 8.9), a bf16 model, no offloading
        and a width measured to pay (>= 1536) for the linears; FA3 at head dim 64-256 on one GPU
        per job for attention. CPU runs neither natively (it would emulate them, slower than
        float32: a correctness path, not a speed-up).
        """
        config = self.experts[0].config
        narrowest = FP8_LAYERS_BY_WIDTH[0][0]
        if self.device.type != "cuda":
            reason = f"device {self.device.type}: FP8 runs natively on CUDA only (elsewhere emulated, slower)"
            return {"fp8_linear": reason, "fp8_attention": reason}
        obstacles = {}
        if not fp8_gemm_supported(self.device):
            capability = ".".join(map(str, torch.cuda.get_device_capability(self.device)))
            obstacles["fp8_linear"] = f"compute capability {capability} < 8.9: no FP8 GEMMs"
        elif self.dtype != torch.bfloat16:
            obstacles["fp8_linear"] = (
                f"dtype {str(self.dtype).removeprefix('torch.')}: FP8 GEMMs need bfloat16"
            )
        elif plan.offload != "none":
            obstacles["fp8_linear"] = f"offload {plan.offload!r}: FP8 linears need resident weights"
        elif config.dim < narrowest:
            obstacles["fp8_linear"] = (
                f"model width {config.dim} < {narrowest}, the narrowest measured: FP8 linears not known to pay"
            )
        elif plan.budget_gib is not None and plan.estimate_gib:
            copies = fp8_copy_bytes(tuple(self.experts), fp8_layers)
            if max(dict(plan.estimate_gib).values()) + copies / GIB > plan.budget_gib:
                obstacles["fp8_linear"] = (
                    f"gpu_memory_gb = {plan.budget_gib:g}: no room for the FP8 weight copies "
                    f"({copies / GIB:.2f} GiB) beside the plan's estimate"
                )
        if not (attention.name == "flash" and attention.provider == "fa3"):
            obstacles["fp8_attention"] = (
                f"attention {attention.name}:{attention.provider}: FP8 needs flash:fa3"
            )
        elif not FP8_HEAD_DIMS[0] <= config.attention_head_dim <= FP8_HEAD_DIMS[1]:
            low, high = FP8_HEAD_DIMS
            obstacles["fp8_attention"] = (
                f"head dim {config.attention_head_dim}: FA3's FP8 forward has {low}-{high}"
            )
        elif not self.layout.is_single:
            obstacles["fp8_attention"] = "several ranks per job: FP8 attention runs on one GPU"
        return obstacles

    def memory_plan(
        self,
        request: _Request,
        offload: str | None = None,
        gpu_memory_gb: float | None = None,
        cfg: str | None = None,
        ffn_chunk: int | None = None,
        decode: str | None = None,
        block_chunk: int | None = None,
        *,
        fp8_layers: frozenset[str] = frozenset(),
    ) -> MemoryPlan:
        """The request's MemoryPlan (arguments None take the pipeline's defaults); raises when it cannot fit.

        fp8_layers: the FP8 linear kinds the request runs; their weight copies count with offload none.
        """
        experts = self.experts
        work = workload(
            self.latents_shape(request.height, request.width, request.num_frames),
            self.transformer.config.patch_size,
            guided=request.guided,
            text_len=request.max_sequence_length,
            size=(request.num_frames, request.height, request.width),
        )
        plan = resolve_plan(
            model_sizes(experts, self.components.text_encoder, self.vae, fp8_layers),
            work,
            offload=self.offload if offload is None else offload,
            gpu_memory_gb=self.gpu_memory_gb if gpu_memory_gb is None else gpu_memory_gb,
            cfg=cfg,
            ffn_chunk=ffn_chunk,
            decode=decode,
            block_chunk=block_chunk,
        )
        if self._explicit_placement and plan.offload != "none":
            raise ValidationError(
                f"offload = {plan.offload!r}: this pipeline was built with its own placement; "
                "offload needs the pipeline's (build it without placement=)"
            )
        return plan

    def _arrange(self, plan: MemoryPlan) -> Placement:
        """Place the weights for plan.offload (a move only when it differs from the last call's) and
        set the FFN token chunk; returns the Placement the loop gets."""
        for expert in self.experts:
            for module in expert.modules():
                if hasattr(module, "token_chunk"):
                    module.token_chunk = plan.ffn_chunk
                if hasattr(module, "block_chunk"):
                    module.block_chunk = plan.block_chunk
        if self._explicit_placement:
            return self.placement
        current = self.placement
        same = isinstance(current, OffloadPlacement) and (current.offload, current.prefetch_experts) == (
            plan.offload,
            plan.prefetch_experts,
        )
        if not same:
            if isinstance(current, OffloadPlacement):
                current.release()
            self.placement = OffloadPlacement(
                plan.offload,
                experts=self.experts,
                text_encoder=self.components.text_encoder,
                vae=self.vae,
                device=self.device,
                prefetch_experts=plan.prefetch_experts,
                host=self._host,
            )
            self._host = None  # closed by the placement: later placements copy into fresh buffers
        return self.placement

    @staticmethod
    def _using(placement: Placement, name: str) -> Any:
        if isinstance(placement, OffloadPlacement):
            return placement.using(name)
        return contextlib.nullcontext()

    def _record(
        self, request: _Request, *, generator: torch.Generator | None, latents: torch.Tensor | None
    ) -> dict[str, Any]:
        """The resolved arguments as a JSON-ready dict (what reproduces this result)."""
        args: dict[str, Any] = {
            "pipeline": type(self).__name__,
            "model": None if self.components.source is None else str(self.components.source),
            "variant": self.variant.task,
            **{
                name: getattr(request, name)
                for name in _Request.__dataclass_fields__
                if name != "image" and not (name in _LOSSY_FIELDS and getattr(request, name) is None)
            },
            "noise": "latents" if latents is not None else ("generator" if generator is not None else "seed"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "vae_dtype": str(self.vae.dtype).removeprefix("torch."),
            "device": str(self.device),
            "fps": self.defaults.fps,
            "defaults": self.defaults.chosen_by,  # where the values of arguments left out came from
        }
        if request.image is not None:
            args["image"] = request.image.source
            args["image_sha256"] = request.image.sha256
            args["image_size"] = [request.image.width, request.image.height]
        if not self.layout.is_single:
            args["parallel"] = self.layout.describe()
        return args

    def _synchronize(self) -> None:
        # Progress and timings must show finished GPU work, not queued launches.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _elapsed(self, tick: float) -> float:
        self._synchronize()
        return time.perf_counter() - tick
