"""The embedded default model follows prompts it never saw, judged by the tiny world's fixed detector.

Held-out prompts name (shape, colour, direction) triples training never drew. The same detector
scores the same prompts on the same architecture with re-initialized DiT and text-encoder weights
(the trained VAE kept, so the frames are still plausible images): near chance there, which shows
the detector discriminates rather than agreeing with anything.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmgen.tiny.world import held_out_prompts
from pipelines.tiny_world.evaluate import follow_rate
from pipelines.wan_t2v import WanT2VPipeline

PROMPTS = held_out_prompts(24)
REQUIRED_RATE = 0.9  # issue 12's target for colour AND direction together
# Chance for colour and direction together is 1/6 * 1/5; a model that ignores the text may still hit
# one direction (e.g. "still") every time, which alone is at most 1/5 of these prompts.
CHANCE_CEILING = 0.25
# Per attribute: the shipped weights (wan-tiny-v4, two H100 calls: 1,400 VAE + 6,000 DiT steps) must
# read back well above chance; re-initialized weights must stay near chance (colour 1/6, direction 1/5,
# background 1/3), so the detector is shown to discriminate on every attribute.
TRAINED_FLOORS = {"background": 0.9, "colour": 0.9, "direction": 0.9}
RANDOM_CEILINGS = {"background": 0.5, "colour": 0.34, "direction": 0.4}


def misses(rows: list[dict]) -> list[str]:
    return [
        f"{r['prompt']!r}: detected {r['detected']['colour']}/{r['detected']['direction']}"
        for r in rows
        if not r["colour_and_direction"]
    ]


def check_rates(rows: list[dict]) -> dict[str, float]:
    return {name: sum(r["checks"][name] for r in rows) / len(rows) for name in rows[0]["checks"]}


@pytest.fixture(scope="module")
def trained(default_model_dir):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)  # the ordinary diffusers-format path
    return follow_rate(pipe, PROMPTS)


@pytest.fixture(scope="module")
def reinitialized(default_model_dir):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (pipe.transformer, pipe.components.text_encoder):
            for name, param in module.named_parameters():
                if param.dim() == 1:  # norm scales and biases: the usual 1 / 0 starting values
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    fan_in = math.prod(param.shape[1:])
                    param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    return follow_rate(pipe, PROMPTS[:12])  # enough to show chance level, half the time


def test_trained_weights_follow_each_attribute_better_than_random(trained, reinitialized):
    trained_rates, random_rates = check_rates(trained[1]), check_rates(reinitialized[1])
    print(f"\ntrained {trained_rates}, re-initialized {random_rates}")
    for name, floor in TRAINED_FLOORS.items():
        assert trained_rates[name] >= floor, (name, trained_rates)
        assert random_rates[name] <= RANDOM_CEILINGS[name], (name, random_rates)
        assert trained_rates[name] > random_rates[name], name


def test_held_out_prompts_are_followed(trained):
    rate, rows = trained
    hits = sum(r["colour_and_direction"] for r in rows)
    print(f"\nheld-out prompts followed (colour and direction): {hits}/{len(rows)} = {rate:.3f}")
    assert rate >= REQUIRED_RATE, misses(rows)


def test_random_weights_score_near_chance(reinitialized):
    rate, rows = reinitialized
    print(
        f"\nre-initialized weights: {sum(r['colour_and_direction'] for r in rows)}/{len(rows)} = {rate:.3f}"
    )
    assert rate <= CHANCE_CEILING
