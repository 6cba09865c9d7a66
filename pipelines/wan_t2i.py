"""Wan text-to-image: the T2V pipeline at one frame (Wan2.1 is trained on images as 1-frame videos)."""

from __future__ import annotations

from typing import Any

from mmgen.errors import ValidationError
from pipelines.common import GenerationResult
from pipelines.request import GenerationRequest
from pipelines.wan_t2v import WanT2VPipeline


class WanT2IPipeline(WanT2VPipeline):
    """`pipe(prompt, ...)` with WanT2VPipeline's arguments except num_frames (always 1).

    result.image is the uint8 image [H, W, 3]; result.save("out.png") writes it.
    """

    @property
    def makes_video(self) -> bool:
        return False

    def generate(self, request: GenerationRequest, **kwargs: Any) -> GenerationResult:
        """Generate one image (result.frames uint8 [1, H, W, 3]): num_frames left out is 1, any other
        count is refused. Checked here, on the request, so `pipe(...)` and `generate` agree."""
        if request.num_frames is None:
            request = request.with_values(num_frames=1)
        elif request.num_frames != 1:
            raise ValidationError(
                f"num_frames = {request.num_frames!r}: WanT2IPipeline makes one frame; use WanT2VPipeline"
            )
        return super().generate(request, **kwargs)
