"""Wan text-to-video: prompt -> UMT5 text -> seeded noise -> DiT denoise loop (batched CFG) -> VAE -> frames.

Numerically this is diffusers' WanPipeline (same text handling, noise, scheduler calls, guidance
formula, latent denormalization and uint8 conversion); it differs in how work is organized: the
request is validated before any work, cond and uncond run as one batch-2 DiT call, the attention
impl and its metadata are values passed to the model, and the result carries hashes, timings and
the environment fingerprint.
"""

from __future__ import annotations

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
from mmgen.attention.metadata import DiTAttention
from mmgen.errors import ValidationError
from mmgen.fingerprint import environment_fingerprint
from mmgen.loading.diffusers_dir import (
    GenerationDefaults,
    WanComponents,
    check_compatible,
    load_wan_components,
)
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.models.umt5 import TextPadding, UMT5Encoder
from mmgen.models.wan import WanDiT
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from mmgen.parallel.attention import self_attention_provider
from mmgen.parallel.launch import resolve_layout
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
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
    Placement,
    ResidentPlacement,
    TextBranch,
    denoise,
    plan_steps,
    split_branches,
)

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

    @property
    def guided(self) -> bool:
        # diffusers' rule: classifier-free guidance only when the scale exceeds 1.
        return self.guidance_scale > 1.0


class WanT2VPipeline:
    """Text-to-video with a Wan2.1-architecture model; `pipe(prompt, ...)` returns a GenerationResult."""

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
    ) -> None:
        defaults = GenerationDefaults() if defaults is None else defaults
        # Values chosen once per pipeline and passed down to every step (DESIGN.md): which process
        # this is among several, and where the weights live.
        self.layout = ParallelLayout.single() if layout is None else layout
        self.placement = ResidentPlacement() if placement is None else placement
        self.layout.check_heads(transformer.config.num_attention_heads)
        self.components = WanComponents(
            transformer, text_encoder, tokenizer, vae, scheduler, defaults, source
        )
        check_compatible(self.components)

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype = torch.float32,
        parallel: ParallelConfig | ParallelLayout | None = None,
    ) -> WanT2VPipeline:
        """Load a local diffusers-format Wan directory; DiT and text encoder in `dtype`, the VAE in `vae_dtype`.

        parallel: a ParallelLayout (from mmgen.parallel.launch.run_parallel's workers), or a
        ParallelConfig resolved in this process (torch.distributed already initialized, or torchrun's
        environment); None = one process. Every rank loads the whole model.
        """
        layout = resolve_layout(parallel, torch.device(device).type)
        c = load_wan_components(Path(directory), dtype=dtype, device=device, vae_dtype=vae_dtype)
        return cls(
            c.transformer,
            c.text_encoder,
            c.tokenizer,
            c.vae,
            c.scheduler,
            defaults=c.defaults,
            source=c.source,
            layout=layout,
        )

    @property
    def transformer(self) -> WanDiT:
        return self.components.transformer

    @property
    def vae(self) -> Any:
        return self.components.vae

    @property
    def defaults(self) -> GenerationDefaults:
        return self.components.defaults

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

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
    ) -> GenerationResult:
        """Generate uint8 frames [T, H, W, 3]; arguments left None take the model directory's defaults.

        Noise: `latents` if given (float [1, z_dim, F', H/8, W/8]), else drawn on the CPU from
        `generator` or from a generator seeded with `seed` (a fresh random seed, recorded in
        result.args, when both are None), so the same seed gives the same noise on any device.
        `progress`: True (a tqdm bar), False, or a ProgressReporter the caller keeps driving after.
        `compile`: compile the DiT's blocks (WanDiT.compile_blocks, which also stacks the q/k/v
        projections) once, on the first call that asks; later calls reuse them. The first compiled
        step takes longer; results stay within bf16 rounding of an uncompiled run.
        """
        started = time.perf_counter()
        request = self._resolve(
            prompt, negative_prompt, height, width, num_frames, num_inference_steps, guidance_scale,
            seed, generator, attention_backend, max_sequence_length, compile,
        )  # fmt: skip
        attention = self.attention_for(request.attention_backend)
        noise = self._initial_latents(request, generator, latents)
        if request.compile and not self.transformer.blocks_compiled:
            self.transformer.compile_blocks()
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
            text, text_lens = self.encode_text(prompts, request.max_sequence_length)
            timings["text_encode"] = self._elapsed(tick)

            tick = time.perf_counter()
            final = self.denoise(noise, self.conditioning(text, text_lens), request, attention, reporter)
            timings["denoise"] = self._elapsed(tick)

            tick = time.perf_counter()
            reporter.stage("decode", 1)
            frames = self.decode(final)
            reporter.advance()
            timings["decode"] = self._elapsed(tick)
        finally:
            if owned:
                reporter.close()
        timings["total"] = time.perf_counter() - started

        providers = dict.fromkeys(ATTENTION_SITES, f"{attention.name}:{attention.provider}")
        providers["transformer.self_attn"] = self_attention_provider(attention, self.layout)
        frames.flags.writeable = False
        final = final.detach().to("cpu", torch.float32)
        args = self._record(request, generator=generator, latents=latents)
        if prompt_enhancer is not None:
            args["prompt_original"] = original_prompt
        return GenerationResult(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents=final,
            latents_sha256=tensor_sha256(final),
            timings=timings,
            fingerprint=environment_fingerprint(
                device=self.device, dtype=self.dtype, attention_providers=providers
            ),
            attention_providers=providers,
            args=args,
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
    ) -> _Request:
        """Fill defaults and validate everything before any work; errors name field, value and allowed."""
        d = self.defaults
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

    def conditioning(self, text: torch.Tensor, text_lens: torch.Tensor) -> Conditioning:
        """Text [1 or 2 (cond, uncond), L, d] and its token counts [1 or 2] -> the loop's Conditioning.

        Metadata is a value built here once per request (the text never changes between steps): for
        the stacked branches and, when guided, for each branch alone (sequential / CFG-parallel steps).
        """
        masked = self.transformer.config.text_mask
        lens = text_lens.to(self.device)

        def metadata(rows: slice) -> DiTAttention:
            return self.transformer.build_attention_metadata(
                lens[rows] if masked else None, text_len=text.shape[1]
            )

        both = TextBranch(text=text, metadata=metadata(slice(None)))
        halves = split_branches(both, lambda row: metadata(slice(row, row + 1))) if text.shape[0] == 2 else ()
        return Conditioning(both=both, halves=halves)

    @torch.no_grad()
    def denoise(
        self,
        latents: torch.Tensor,
        conditioning: Conditioning,
        request: _Request,
        attention: Any,
        progress: ProgressReporter,
    ) -> torch.Tensor:
        """float32 latents [1, C, F', H', W'] -> final float32 latents, through pipelines.denoise."""
        scheduler = type(self.components.scheduler).from_config(self.components.scheduler.config)
        scheduler.set_timesteps(request.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        steps = plan_steps(scheduler.timesteps, (request.guidance_scale,))
        models = DenoiseModels(
            experts=(self.transformer,),
            attention=attention,
            layout=self.layout,
            placement=self.placement,
            dtype=self.dtype,
        )
        return denoise(
            latents, steps, scheduler, conditioning, models, progress=progress, synchronize=self._synchronize
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> Any:
        """Final latents [1, z_dim, F', H', W'] -> uint8 frames [T, H, W, 3] (numpy), as diffusers decodes."""
        vae = self.vae
        config = vae.config
        device = next(vae.parameters()).device
        z = latents.to(device=device, dtype=vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(device, z.dtype)
        # diffusers divides by the reciprocal of std computed in the VAE dtype; kept for identical bits.
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]
        return video_to_uint8(video)

    def _record(
        self, request: _Request, *, generator: torch.Generator | None, latents: torch.Tensor | None
    ) -> dict[str, Any]:
        """The resolved arguments as a JSON-ready dict (what reproduces this result)."""
        args: dict[str, Any] = {
            "pipeline": type(self).__name__,
            "model": None if self.components.source is None else str(self.components.source),
            **{name: getattr(request, name) for name in _Request.__dataclass_fields__},
            "noise": "latents" if latents is not None else ("generator" if generator is not None else "seed"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "vae_dtype": str(self.vae.dtype).removeprefix("torch."),
            "device": str(self.device),
            "fps": self.defaults.fps,
        }
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
