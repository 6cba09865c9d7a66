"""What only the loaded model can judge is a 400 at POST time, naming the field the client sent, not a
failed job: the service's model check runs the pipeline's own checks (pipelines.wan_plan.resolve_defaults)
on a stand-in pipeline with a larger spatial multiple and temporal stride than the default model's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")

from mmgen.loading.wan_components import GenerationDefaults
from mmgen.serve.protocol import ApiError, Limits, image_submission, video_submission
from pipelines.wan_variant import WanVariant


def stand_in(variant: WanVariant, spatial: int = 32, stride: int = 8) -> SimpleNamespace:
    """What resolve_defaults reads of a pipeline: defaults, variant, multiples, the DiT's config;
    check_request as WanT2VPipeline.check_request runs it."""
    from pipelines.wan_plan import resolve_defaults

    pipe = SimpleNamespace(
        defaults=GenerationDefaults(height=64, width=64, num_frames=17, fps=8),
        variant=variant,
        spatial_multiple=spatial,
        temporal_stride=stride,
        transformer=SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2), text_len=512)),
    )
    pipe.check_request = lambda request: resolve_defaults(request, pipe, seeded=False)[0]
    return pipe


def limits_for(pipe: SimpleNamespace, **dirs: Path) -> Limits:
    from mmgen.serve.service import _model_check

    return Limits(
        model="m", height=64, width=64, num_frames=17, fps=8,
        model_check=lambda request: _model_check(pipe, request), **dirs,
    )  # fmt: skip


def refused(call, *args, **kwargs) -> tuple[str | None, str]:
    with pytest.raises(ApiError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value.param, caught.value.message


def test_model_dependent_refusals_name_the_field_sent(tmp_path: Path) -> None:
    from PIL import Image

    t2v = limits_for(stand_in(WanVariant()))
    assert (
        video_submission({"prompt": "p", "size": "64x64", "num_frames": 17}, t2v).fields["num_frames"] == 17
    )
    # 48 is a multiple of 16 (the request's own check) but not of this model's 32
    assert refused(video_submission, {"prompt": "p", "size": "48x64"}, t2v)[0] == "size"
    assert refused(video_submission, {"prompt": "p", "height": 48}, t2v)[0] == "height"
    # 13 frames is 4k+1 but not 8k+1; 1.5 s at 8 fps is 13 frames too
    param, message = refused(video_submission, {"prompt": "p", "num_frames": 13}, t2v)
    assert param == "num_frames" and "8k+1" in message
    assert refused(video_submission, {"prompt": "p", "seconds": "1.5"}, t2v)[0] == "seconds"
    assert refused(video_submission, {"prompt": "p", "guidance_scale_2": 3.0}, t2v)[0] == "guidance_scale_2"
    assert refused(image_submission, {"prompt": "p", "size": "48x48"}, t2v)[0] == "size"
    png = tmp_path / "in.png"
    Image.fromarray(np.full((64, 64, 3), 9, np.uint8)).save(png)
    param, message = refused(
        video_submission, {"prompt": "p"}, t2v, {"input_reference": [png]}
    )  # an uploaded input_reference
    assert param == "input_reference" and "text-to-video only" in message
    with_dir = limits_for(stand_in(WanVariant()), input_dir=tmp_path)
    assert refused(video_submission, {"prompt": "p", "image": "in.png"}, with_dir)[0] == "image"

    i2v = limits_for(stand_in(WanVariant(image_mode="concat", mask_channels=8)))
    param, message = refused(video_submission, {"prompt": "p"}, i2v)
    assert param == "input_reference" and "image-to-video" in message
    assert video_submission({"prompt": "p"}, i2v, {"input_reference": [png]}).fields["image"] == str(png)
