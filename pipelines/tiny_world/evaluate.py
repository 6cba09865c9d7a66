"""Prompt following of a model on held-out prompts: `python3 -m pipelines.tiny_world.evaluate [--model DIR]`.

Prints, per (steps, guidance) setting, how many of the held-out prompts the detector reads back
with the right colour and direction; used to choose the default model's generation defaults and,
through `follow_rate`, by the prompt-following test.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmgen.default_model import ensure_default_model
from mmgen.tiny.detector import prompt_following_score
from mmgen.tiny.world import held_out_prompts
from pipelines.wan_t2v import WanT2VPipeline

SEED_BASE = 1000  # prompt i is generated with seed SEED_BASE + i (the test's seeds)
# Seeds for choosing the generation defaults (--seed-base): the same prompts, other noise, so the
# settings are not tuned on the very samples the prompt-following test scores.
TUNING_SEED_BASE = 5000


def follow_rate(
    pipe: Any, prompts: list[str], *, seed_base: int = SEED_BASE, **options: Any
) -> tuple[float, list[dict]]:
    """(fraction of prompts whose colour and direction the detector reads back, one row per prompt).

    `pipe` is a WanT2VPipeline; prompt i is generated with seed `seed_base` + i; `options` go to each
    call (num_inference_steps, guidance_scale, ...).
    """
    rows = []
    for i, prompt in enumerate(prompts):
        frames = pipe(prompt, seed=seed_base + i, progress=False, **options).frames
        rows.append({"prompt": prompt, **prompt_following_score(frames, prompt)})
    return sum(r["colour_and_direction"] for r in rows) / len(rows), rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python3 -m pipelines.tiny_world.evaluate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the embedded one)"
    )
    parser.add_argument("--count", type=int, default=24, help="number of held-out prompts")
    parser.add_argument("--steps", type=int, nargs="+", default=[8])
    parser.add_argument("--guidance", type=float, nargs="+", default=[4.0])
    parser.add_argument(
        "--seed-base",
        type=int,
        default=SEED_BASE,
        help=f"seed of the first prompt ({TUNING_SEED_BASE}: the seeds used to choose the defaults)",
    )
    args = parser.parse_args(argv)
    pipe = WanT2VPipeline.from_pretrained(args.model or ensure_default_model())
    prompts = held_out_prompts(args.count)
    print(
        f"{'steps':>5} {'guidance':>8} {'colour+direction':>16} {'colour':>6} {'direction':>9} {'background':>10}"
    )
    for steps in args.steps:
        for guidance in args.guidance:
            rate, rows = follow_rate(
                pipe, prompts, seed_base=args.seed_base, num_inference_steps=steps, guidance_scale=guidance
            )
            parts = [
                sum(r["checks"].get(k, False) for r in rows) / len(rows)
                for k in ("colour", "direction", "background")
            ]
            print(
                f"{steps:>5} {guidance:>8.1f} {rate:>16.3f} {parts[0]:>6.3f} {parts[1]:>9.3f} {parts[2]:>10.3f}"
            )


if __name__ == "__main__":
    main()
