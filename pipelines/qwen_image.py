"""Qwen-Image text-to-image: the pipeline class (components, loading, placement); the rest is its hooks.

A call is the one prepare -> run -> record every family runs (pipelines.pipeline.Pipeline); what
Qwen-Image does differently - packing, schedule and shift, the chat-template text, true CFG, the
joint-attention model call - is pipelines.qwen_image_family.QwenImageHooks, numerically diffusers'
QwenImagePipeline. Qwen-Image-Edit (pipelines.qwen_image_edit) is this class with Edit's hooks.

Presets of the Qwen-Image family (pipelines.presets: `lightning-8step`, `lightning-4step`, the
Qwen-Image-Lightning LoRAs' schedule) replace the checkpoint's scheduler config for the call.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.defaults import GenerationDefaults
from mmgen.loading.qwen_image_classes import PIPELINE_CLASS
from mmgen.loading.qwen_image_dir import (
    QwenImageComponents,
    load_qwen_image_components,
    qwen_pipeline_class,
)
from mmgen.loading.qwen_tokenizer import QwenTokenizer
from mmgen.lora import LoRASlot, read_lora_file
from mmgen.lora.qwen_image import parse_qwen_image_lora
from mmgen.models.qwen_image import QwenImageTransformer
from mmgen.models.qwen_image_text import QwenTextEncoder, QwenVisionTextEncoder
from mmgen.parallel.layout import ParallelLayout
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.policy import check_offload
from mmgen.placement.tensors import PinnedStore
from pipelines.capabilities import Capabilities
from pipelines.devices import check_device, check_dtype
from pipelines.pipeline import Pipeline
from pipelines.plan import GenerationPlan
from pipelines.qwen_image_family import QwenImageHooks

# What a Qwen-Image model does: the request fields that apply follow from it (pipelines.capabilities).
CAPABILITIES = Capabilities(
    "image",
    ("t2i",),
    notes=(
        (
            "edit",
            "this directory is Qwen-Image, text-to-image; an image to edit needs a Qwen-Image-Edit directory",
        ),
    ),
)
# The values of request fields a call leaves out: diffusers' QwenImagePipeline.__call__ defaults
# (default_sample_size 128 x VAE scale 8 = 1024 pixels; no negative prompt, so no true CFG unless one
# is given). fps: what an image records (a png has none).
DEFAULTS = GenerationDefaults(
    height=1024,
    width=1024,
    num_frames=1,
    num_inference_steps=50,
    guidance_scale=4.0,
    negative_prompt=None,
    max_sequence_length=512,
    fps=1,
    chosen_by="diffusers' QwenImagePipeline defaults",
)


class QwenImagePipeline(Pipeline):
    """Qwen-Image T2I: `pipe(prompt, negative_prompt=None, **request fields)` or `pipe.generate(request)`
    returns a GenerationResult."""

    directory_class = PIPELINE_CLASS  # the model_index.json _class_name from_pretrained loads
    variant = "t2i"
    capabilities = CAPABILITIES
    hooks = QwenImageHooks()

    def __init__(
        self,
        transformer: QwenImageTransformer,
        text_encoder: QwenTextEncoder | QwenVisionTextEncoder,
        tokenizer: QwenTokenizer,
        vae: Any,
        scheduler: Any,
        *,
        source: Path | None = None,
        device: str | torch.device | None = None,
        offload: str | None = None,
        host: PinnedStore | None = None,
        image_processor: Any = None,
    ) -> None:
        self.components = QwenImageComponents(
            transformer, text_encoder, tokenizer, vae, scheduler, source, image_processor
        )
        self.layout = ParallelLayout.single()  # one process: it owns its outputs
        # The LoRAs on the transformer now: each call states its own; an unchanged set stays applied.
        self.loras = LoRASlot(reader=functools.partial(read_lora_file, parse=parse_qwen_image_lora))
        self._device = transformer.img_in.weight.device if device is None else torch.device(device)
        # Where the weights live, chosen once here (mmgen.placement): 'none' all on the device; 'model'
        # each component copied in while it runs; 'layer' the transformer's blocks streamed as well.
        self.offload = check_offload("none" if offload is None else offload)
        self.placement = OffloadPlacement(
            self.offload,
            experts=(transformer,),
            text_encoder=text_encoder.module,
            vae=vae,
            device=self._device,
            host=host,  # the buffers the weights were loaded into: adopted, then the store is closed
        )
        latent_channels = transformer.config.in_channels // 4
        if (
            latent_channels != vae.config.z_dim
            or transformer.config.joint_attention_dim != text_encoder.hidden_size
        ):
            raise ValidationError(
                f"components do not fit: transformer in_channels {transformer.config.in_channels} (4 x the VAE's "
                f"z_dim {vae.config.z_dim}?), joint_attention_dim {transformer.config.joint_attention_dim} "
                f"(the text encoder's hidden size {text_encoder.hidden_size}?)"
            )

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype | str = torch.float32,
        torch_dtype: torch.dtype | str | None = None,
        offload: str | None = None,
    ) -> QwenImagePipeline:
        """Load a local diffusers-format Qwen-Image directory (mmgen.loading.qwen_image_dir); transformer
        and text encoder in `dtype` (default float32), the VAE in `vae_dtype`. To reproduce a diffusers
        image loaded with torch_dtype=bfloat16, load with dtype and vae_dtype bfloat16.
        offload: 'none' (default), 'model' or 'layer' (the weights load into host memory and stay there,
        copied to `device` while they run; 'layer' streams the transformer's blocks: the 20B model in
        bf16 runs on a 24 GB GPU)."""
        dtype, vae_dtype = check_dtype(dtype, torch_dtype=torch_dtype), check_dtype(vae_dtype)
        device = check_device(device)
        offload = "none" if offload is None else check_offload(offload)
        found = qwen_pipeline_class(directory)
        if found is not None and found != cls.directory_class:
            raise LoadError(
                f"{directory}: model_index.json names {found}; {cls.__name__} loads {cls.directory_class} "
                "directories (pipelines.loader.load_pipeline picks the class from the directory)"
            )
        # Weights bound for offload are read straight into page-locked buffers (pinned when the device
        # is a GPU) that the placement adopts.
        host = None if offload == "none" else PinnedStore(register=torch.device(device).type == "cuda")
        c = load_qwen_image_components(
            directory, dtype=dtype, device=device if host is None else "cpu", vae_dtype=vae_dtype, host=host
        )
        return cls(
            c.transformer,
            c.text_encoder,
            c.tokenizer,
            c.vae,
            c.scheduler,
            source=c.source,
            device=device,
            offload=offload,
            host=host,
            image_processor=c.image_processor,
        )

    @property
    def defaults(self) -> GenerationDefaults:
        """The values a request leaves out (the server maps `size` and checks bounds with them)."""
        return DEFAULTS

    @property
    def makes_video(self) -> bool:
        """False: Qwen-Image makes one image per call (the server answers /v1/videos with a 400)."""
        return self.capabilities.outputs == "video"

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along a side: 2 ** (the VAE's temporal-downsample entries), 8 for Qwen-Image."""
        return 2 ** len(self.vae.config.temperal_downsample)

    @property
    def spatial_multiple(self) -> int:
        """Heights and widths must be multiples of this: 16 and VAE scale x patch size."""
        return math.lcm(16, self.vae_scale * self.transformer.config.patch_size)

    def arrange(self, plan: GenerationPlan) -> OffloadPlacement:
        """The placement the loop gets: the one chosen at load (a request cannot change it)."""
        return self.placement
