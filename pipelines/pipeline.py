"""The pipeline every family's class builds on: the Python call, generate, the request check, decode.

A family's pipeline class holds what lives across calls (its components, the parallel layout, where
the weights live, the LoRAs now applied) and names its hooks (pipelines.family.FamilyHooks); this
base runs a call as the one prepare -> run -> record (pipelines.plan, pipelines.run, pipelines.record).
A subclass sets `hooks` and `_device` and has `components` (transformer, vae, ...), `layout`,
`loras`, `defaults` and `arrange(plan)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmgen.attention import select_attention
from mmgen.errors import ValidationError
from mmgen.parallel.vae_decode import split_decode
from mmgen.progress import ProgressReporter
from pipelines.common import GenerationResult, video_to_uint8
from pipelines.devices import synchronize
from pipelines.memory import decode_latents, latent_stats
from pipelines.plan import prepare
from pipelines.record import record
from pipelines.request import GenerationRequest
from pipelines.run import run


class Pipeline:
    """`pipe(prompt, negative_prompt=None, **request fields)` or `pipe.generate(request)` -> a GenerationResult."""

    hooks: Any  # the family's FamilyHooks
    capabilities: Any  # pipelines.capabilities.Capabilities: what the loaded model does
    _device: torch.device

    @property
    def transformer(self) -> Any:
        return self.components.transformer

    @property
    def vae(self) -> Any:
        return self.components.vae

    @property
    def experts(self) -> tuple[Any, ...]:
        """The transformers by StepPlan.expert (one, unless the family has several)."""
        return (self.transformer,)

    @property
    def device(self) -> torch.device:
        """Where the DiT computes (the weights may be elsewhere under offload)."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def makes_video(self) -> bool:
        """Whether a request may ask for more than one frame (the server's /v1/videos needs it)."""
        return True

    @property
    def edits_images(self) -> bool:
        """Whether the model edits an input image (the server's /v1/images/edits needs it)."""
        return self.capabilities.has("edit")

    def check_request(self, request: GenerationRequest) -> GenerationRequest:
        """What `generate` would refuse in `request` that depends on this model (its multiples, variant,
        defaults), raised without running or drawing anything (the server checks requests with it);
        returns the request with this model's defaults filled in (no seed drawn)."""
        return self.hooks.resolve(self, request, seeded=False)[0]

    def attention_for(self, backend: str) -> Any:
        """The attention impl `backend` ('auto', 'flash', 'sdpa', ...) resolves to for this model."""
        return select_attention(
            backend, device=self.device, dtype=self.dtype, head_dim=self.transformer.config.attention_head_dim
        )

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        progress: bool | ProgressReporter = True,
        prompt_enhancer: Callable[[str], str] | None = None,
        **fields: Any,
    ) -> GenerationResult:
        """Generate uint8 frames [T, H, W, 3]; `fields` are pipelines.request.GenerationRequest's.

        Every generation option (height, width, num_frames, num_inference_steps, guidance_scale,
        seed, attention_backend, image, offload, cfg, lora, preset, ...) is a field of the one request
        value, which documents, types and checks it; those left None take the model's defaults. The
        call builds that value, then `generate` runs it.

        Noise: `latents` if given (the family's shape: see its hooks' initial_latents), else drawn on
        the CPU from `generator` or from a generator seeded with `seed` (a fresh random seed,
        recorded in result.args, when all three are None), so the same seed gives the same noise on
        any device. `progress`: True (a tqdm bar), False, or a ProgressReporter the caller keeps
        driving after. `prompt_enhancer`: str -> str, run on the prompt before encoding
        (args['prompt_original']).
        """
        request = GenerationRequest.from_pipeline_call(prompt, negative_prompt, **fields)
        return self.generate(
            request, generator=generator, latents=latents, progress=progress, prompt_enhancer=prompt_enhancer
        )

    @torch.no_grad()
    def generate(
        self,
        request: GenerationRequest,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        progress: bool | ProgressReporter = True,
        prompt_enhancer: Callable[[str], str] | None = None,
    ) -> GenerationResult:
        """The request, in three steps: prepare (the frozen plan; every error before any work), run, record."""
        if request.seed is not None and generator is not None:
            raise ValidationError("pass either seed or generator, not both")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValidationError("generator must be a CPU torch.Generator (noise is drawn on the CPU)")
        plan = prepare(request, self, seeded=generator is None and latents is None)
        output = run(
            self,
            plan,
            generator=generator,
            latents=latents,
            progress=progress,
            prompt_enhancer=prompt_enhancer,
        )
        return record(self, plan, output, generator=generator, latents=latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, mode: str = "full") -> Any:
        """Final latents [1, z_dim, F', H', W'] -> uint8 frames [T, H, W, 3] (numpy), as diffusers decodes.

        mode: 'full' (diffusers' decode), 'frames' (the same, bit for bit, without the whole float
        video on the device) or 'tiled' (lossy); see pipelines.memory.decode_latents. 'split': each
        rank of the layout decodes a band of the frames (mmgen.parallel.vae_decode; exact up to conv
        rounding), gathered on every rank; 'bands2/4/8' spread their bands over the ranks (the same
        bits as on one process).
        """
        vae = self.vae
        device = next(vae.parameters()).device
        z = latents.to(device=device, dtype=vae.dtype)
        # diffusers divides by the reciprocal of std computed in the VAE dtype; kept for identical bits.
        mean, inv_std = latent_stats(vae, device, z.dtype)
        if mode == "split":
            return split_decode(vae, z / inv_std + mean, self.layout, video_to_uint8)
        return decode_latents(vae, z / inv_std + mean, mode, self.layout)

    def synchronize(self) -> None:
        """Wait for queued GPU work: progress and timings show finished work, not queued launches."""
        synchronize(self.device)
