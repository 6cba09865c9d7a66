"""Contact sheet of the default model: `python3 -m pipelines.tiny_world.sheet --out docs/default_model.png`.

One row per prompt: its caption, then every other frame of the generated clip, enlarged with
nearest-neighbour scaling, and the detector's reading, so a reader sees what `mmgen generate` makes
on the embedded default before running it. Held-out prompts are marked: training never saw them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmgen.default_model import ensure_default_model
from mmgen.outputs.writers import write_png
from mmgen.tiny.detector import prompt_following_score
from mmgen.tiny.world import HELD_OUT, held_out_prompts, parse_caption
from pipelines.wan_t2v import WanT2VPipeline

PROMPTS = (
    "a red circle moves right on a black background",
    "a blue square moves up on a white background",
    "a yellow star moves left on a gray background",
    "a green triangle moves down on a black background",
    *held_out_prompts(4)[1:4],
)
SCALE = 3
LABEL_HEIGHT = 14
SEED = 1


def contact_sheet(frames_per_prompt: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """[(prompt, uint8 frames [T, H, W, 3])] -> one uint8 image [rows * (label + H*SCALE), cols * W*SCALE, 3]."""
    rows = []
    for prompt, frames in frames_per_prompt:
        shown = frames[::2]
        strip = np.concatenate(
            [np.kron(f, np.ones((SCALE, SCALE, 1), dtype=np.uint8)) for f in shown], axis=1
        )
        label = Image.new("RGB", (strip.shape[1], LABEL_HEIGHT), (255, 255, 255))
        found = parse_caption(prompt)
        held = (found["shape"], found["colour"], found["direction"]) in HELD_OUT
        reading = prompt_following_score(frames, prompt)["detected"]
        text = (
            f"{prompt}{' [held out]' if held else ''} -> detected {reading['colour']}, {reading['direction']}"
        )
        ImageDraw.Draw(label).text((2, 1), text, fill=(0, 0, 0))
        rows += [np.asarray(label), strip]
    return np.concatenate(rows, axis=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python3 -m pipelines.tiny_world.sheet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="PNG path")
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the embedded one)"
    )
    args = parser.parse_args(argv)
    pipe = WanT2VPipeline.from_pretrained(args.model or ensure_default_model())
    clips = [(p, pipe(p, seed=SEED, progress=False).frames) for p in PROMPTS]
    print(write_png(contact_sheet(clips), args.out))


if __name__ == "__main__":
    main()
