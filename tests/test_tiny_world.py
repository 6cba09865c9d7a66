"""The tiny world and its detector: held-out combinations never trained on, the detector right on clean renders."""

from __future__ import annotations

import numpy as np
import pytest

from mmgen.tiny.detector import detect, prompt_following_score
from mmgen.tiny.world import (
    BACKGROUNDS,
    COLOURS,
    DIRECTIONS,
    HELD_OUT,
    SHAPES,
    held_out_prompts,
    held_out_scenes,
    parse_caption,
    render,
    sample_scene,
)


def test_training_never_draws_a_held_out_combination():
    rng = np.random.default_rng(0)
    drawn = {(s.shape, s.colour, s.direction) for s in (sample_scene(rng, "train") for _ in range(3000))}
    assert drawn.isdisjoint(HELD_OUT)
    assert len(drawn) == len(SHAPES) * len(COLOURS) * len(DIRECTIONS) - len(HELD_OUT)
    # Every colour and every direction is still seen in training, only not in these triples.
    assert {c for _, c, _ in drawn} == set(COLOURS) and {d for _, _, d in drawn} == set(DIRECTIONS)


def test_held_out_prompts_name_held_out_triples():
    prompts = held_out_prompts(24)
    assert len(set(prompts)) == 24
    for prompt in prompts:
        found = parse_caption(prompt)
        assert (found["shape"], found["colour"], found["direction"]) in HELD_OUT
        assert found["background"] in BACKGROUNDS


def test_scenes_are_deterministic_from_the_seed():
    a = sample_scene(np.random.default_rng(7))
    b = sample_scene(np.random.default_rng(7))
    assert a == b and np.array_equal(render(a), render(b))


@pytest.mark.parametrize("scene", held_out_scenes(12), ids=lambda s: s.caption.replace(" ", "_"))
def test_detector_reads_clean_renders(scene):
    frames = render(scene)
    assert frames.shape == (9, 48, 48, 3) and frames.dtype == np.uint8
    result = prompt_following_score(frames, scene.caption)
    assert result["checks"] == {"colour": True, "direction": True, "background": True}, result


def test_detector_on_noise_and_on_an_empty_frame():
    empty = np.full((9, 48, 48, 3), 240, dtype=np.uint8)
    assert detect(empty).colour is None and detect(empty).background == "white"
    assert not prompt_following_score(empty, "a red circle moves left on a white background")[
        "colour_and_direction"
    ]
    with pytest.raises(ValueError, match="uint8"):
        detect(empty.astype(np.float32))
