"""Wan text-to-image: the T2V pipeline at one frame (Wan2.1 is trained on images as 1-frame videos)."""

from __future__ import annotations

from typing import Any

from mmgen.errors import ValidationError
from pipelines.common import GenerationResult
from pipelines.wan_t2v import WanT2VPipeline


class WanT2IPipeline(WanT2VPipeline):
    """`pipe(prompt, ...)` with WanT2VPipeline's arguments except num_frames (always 1).

    result.image is the uint8 image [H, W, 3]; result.save("out.png") writes it.
    """

    def __call__(self, prompt: str, negative_prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """Generate one image; result.frames is uint8 [1, H, W, 3]."""
        frames = kwargs.pop("num_frames", 1)
        if frames != 1:
            raise ValidationError(
                f"num_frames = {frames!r}: WanT2IPipeline makes one frame; use WanT2VPipeline"
            )
        return super().__call__(prompt, negative_prompt, num_frames=1, **kwargs)
