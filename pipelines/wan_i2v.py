"""Wan image-to-video: WanT2VPipeline with `image=` required (the variant comes from the checkpoint)."""

from __future__ import annotations

from typing import Any

from mmgen.errors import ValidationError
from pipelines.common import GenerationResult
from pipelines.request import GenerationRequest
from pipelines.wan_t2v import WanT2VPipeline


class WanI2VPipeline(WanT2VPipeline):
    """`pipe(prompt, image=..., ...)` for I2V (Wan2.1 I2V, Wan2.2 I2V-A14B) and TI2V checkpoints."""

    def generate(self, request: GenerationRequest, **kwargs: Any) -> GenerationResult:
        """The request needs an image (checked on the request, so `pipe(...)` and `generate` agree)."""
        if request.image is None:
            raise ValidationError(
                "WanI2VPipeline needs image= (a PNG/JPEG/WebP path or uint8 [H, W, 3] array)"
            )
        return super().generate(request, **kwargs)
