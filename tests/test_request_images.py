"""The request's `image`: one input image or several (Qwen-Image-2.1's condition images), RGBA kept, the
count and sides bounded; which models take several (capabilities), and the 2.1-only request fields."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmgen.errors import ValidationError
from pipelines.capabilities import Capabilities
from pipelines.image_input import MAX_IMAGE_SIDE, MAX_INPUT_IMAGES, read_image
from pipelines.qwen_image21_family import CAPABILITIES as QWEN21
from pipelines.request import GenerationRequest


def _png(path, channels=3, size=(24, 16), seed=0):
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], channels) * 255).astype(np.uint8)
    Image.fromarray(pixels, mode="RGBA" if channels == 4 else "RGB").save(path)
    return pixels


def test_one_image_or_several(tmp_path):
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    _png(first)
    _png(second, channels=4, seed=1)
    one = GenerationRequest.from_call(prompt="x", image=str(first))
    listed = GenerationRequest.from_call(prompt="x", image=[str(first)])
    several = GenerationRequest.from_call(prompt="x", image=[str(first), str(second)])
    assert one.image.sha256 == listed.image.sha256 and not isinstance(listed.image, tuple)  # one: as before
    assert isinstance(several.image, tuple) and [i.source for i in several.images] == [
        str(first),
        str(second),
    ]
    record = several.record()
    assert record["image"] == [str(first), str(second)] and len(record["image_sha256"]) == 2
    assert one.record()["image_sha256"] == one.image.sha256
    again = GenerationRequest.from_call(**{k: v for k, v in record.items() if k != "image_sha256"})
    assert [i.sha256 for i in again.images] == record["image_sha256"]  # the record builds it again


def test_the_count_is_bounded_and_named(tmp_path):
    path = tmp_path / "a.png"
    _png(path)
    with pytest.raises(ValidationError, match=rf"image: {MAX_INPUT_IMAGES + 1} images given; give 1 to 4"):
        GenerationRequest.from_call(prompt="x", image=[str(path)] * (MAX_INPUT_IMAGES + 1))
    assert f"at most {MAX_INPUT_IMAGES}" in GenerationRequest.model_fields["image"].description


def test_rgba_is_kept_and_rgb_models_read_what_they_read(tmp_path):
    """An RGBA PNG keeps its alpha (hashed with it); pil() gives the RGB a plain read gives."""
    path = tmp_path / "rgba.png"
    pixels = _png(path, channels=4)
    image = read_image(str(path))
    assert image.has_alpha and image.pixels.shape == (16, 24, 4)
    np.testing.assert_array_equal(np.asarray(image.pil("RGBA")), pixels)
    with Image.open(path) as opened:
        np.testing.assert_array_equal(np.asarray(image.pil()), np.asarray(opened.convert("RGB")))
    assert image.sha256 == read_image(pixels).sha256  # a file and the same array hash alike
    rgb = read_image(str(_png_path(tmp_path)))
    assert not rgb.has_alpha and rgb.pil("RGBA").getchannel("A").getextrema() == (255, 255)


def _png_path(tmp_path):
    path = tmp_path / "rgb.png"
    _png(path)
    return path


def test_a_side_over_the_bound_is_refused_before_decoding(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("L", (MAX_IMAGE_SIDE + 1, 1)).save(path)
    with pytest.raises(ValidationError, match=rf"image: .*{MAX_IMAGE_SIDE + 1}x1 pixels; .* at most 8192"):
        GenerationRequest.from_call(prompt="x", image=str(path))
    with pytest.raises(ValidationError, match="at most 8192 pixels a side"):
        read_image(np.zeros((2, MAX_IMAGE_SIDE + 1, 3), np.uint8))


def test_several_images_only_where_the_model_reads_several(tmp_path):
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        _png(path)
    request = GenerationRequest.from_call(prompt="x", image=[str(p) for p in paths])
    edit = Capabilities("image", ("edit",))
    assert edit.refusals(request, "Edit") == [
        "image: 2 given; the Edit pipeline takes one (it reads one input image (several condition images "
        "are Qwen-Image-2.1's))"
    ]
    assert QWEN21.refusals(request, "Qwen-Image-2.1") == []
    wan = Capabilities.every_feature("video", ("t2v", "i2v"))  # the shared pipeline's features only
    assert len(wan.refusals(request, "Wan")) == 1 and not wan.has("several_images")
    t2i = Capabilities("image", ("t2i",))  # takes no image at all: one line, the field's own
    (line,) = t2i.refusals(request, "T")
    assert line.startswith("image = (") and "it takes no input image" in line


def test_wan_refuses_several_images_naming_image(tmp_path):
    from pipelines.wan_plan import resolve_defaults
    from pipelines.wan_variant import WanVariant

    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        _png(path)
    request = GenerationRequest.from_call(prompt="x", image=[str(p) for p in paths])
    pipe = type(
        "Stand", (), {"defaults": None, "variant": WanVariant(image_mode="concat", mask_channels=8)}
    )()
    with pytest.raises(ValidationError, match="^image: 2 given; the Wan pipeline takes one"):
        resolve_defaults(request, pipe)


def test_qwen_image21_fields_are_refused_elsewhere():
    request = GenerationRequest.from_call(prompt="x", no_prefix_cache=True, output_resolution=512)
    lines = Capabilities("image", ("t2i",)).refusals(request, "Qwen-Image")
    assert [line.split(" = ")[0] for line in lines] == ["output_resolution", "no_prefix_cache"]
    assert "it has no cached prefix" in lines[1]
    assert QWEN21.refusals(request, "Qwen-Image-2.1") == []
    with pytest.raises(
        ValidationError, match="output_resolution = 16: should be greater than or equal to 32"
    ):
        GenerationRequest.from_call(prompt="x", output_resolution=16)


def test_generate_flags_repeat_the_image(tmp_path):
    import argparse

    from mmgen.cli import add_request_flags, generate_request

    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        _png(path)
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    add_request_flags(parser)
    args = parser.parse_args(["x", "--image", str(paths[0]), "--image", str(paths[1]), "--no-prefix-cache"])
    request = generate_request(args)
    assert [i.source for i in request.images] == [str(p) for p in paths] and request.no_prefix_cache
    one = generate_request(parser.parse_args(["x", "--image", str(paths[0])]))
    assert one.image.source == str(paths[0])
