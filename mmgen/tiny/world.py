"""The tiny default model's world: one shape in a named colour moving in a named direction on a plain background.

A scene is a value (`Scene`): categorical attributes from the vocabulary below plus a start centre,
radius and travel, all drawn from a seeded numpy generator, so a seed names a scene on every machine.
`render_batch` draws many scenes at once in torch (on the training GPU or the CPU); frames are
uint8-valued, anti-aliased by 4x4 supersampling.

Held-out combinations: HELD_OUT lists (shape, colour, direction) triples that training never draws
(`sample_scene(..., split="train")`); `held_out_prompts()` builds the prompts the prompt-following
test generates from them, so the test checks composition, not recall of seen captions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle", "star")
# Foreground colours are saturated and at least 45 degrees of hue apart, so a hue detector tells them apart.
COLOURS: Mapping[str, tuple[int, int, int]] = MappingProxyType(
    {
        "red": (225, 35, 35),
        "yellow": (235, 215, 30),
        "green": (35, 190, 55),
        "cyan": (30, 205, 215),
        "blue": (45, 75, 235),
        "purple": (165, 55, 225),
    }
)
# Backgrounds are achromatic: the foreground's hue is then the only hue in the frame.
BACKGROUNDS: Mapping[str, tuple[int, int, int]] = MappingProxyType(
    {
        "black": (12, 12, 12),
        "gray": (125, 125, 125),
        "white": (240, 240, 240),
    }
)
DIRECTIONS: Mapping[str, tuple[float, float]] = MappingProxyType(
    {  # unit step in (x, y), y down as in images
        "left": (-1.0, 0.0),
        "right": (1.0, 0.0),
        "up": (0.0, -1.0),
        "down": (0.0, 1.0),
        "still": (0.0, 0.0),
    }
)
# Every word a caption uses, for the tokenizer.
VOCABULARY = (
    ("a", "moves", "stays", "on", "background", *SHAPES, *COLOURS, *BACKGROUNDS)
    + tuple(d for d in DIRECTIONS if d != "still")
    + ("still",)
)
# (shape, colour, direction) triples never drawn for training: two per colour, every direction and
# shape at least twice. Chosen by rule (i-th colour with shape/direction i and i+2) so the set is plain.
HELD_OUT: tuple[tuple[str, str, str], ...] = tuple(
    (SHAPES[(i + k) % len(SHAPES)], colour, tuple(DIRECTIONS)[(i + k) % len(DIRECTIONS)])
    for i, colour in enumerate(COLOURS)
    for k in (0, 2)
)
TRAVEL = 0.36  # distance the centre moves over the clip, as a fraction of the frame width
RADIUS = (0.13, 0.17)  # shape radius range, fraction of the frame width
SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    """One clip: attribute names plus geometry in fractions of the frame (centre x, y at the clip's middle)."""

    shape: str
    colour: str
    direction: str
    background: str
    centre: tuple[float, float]
    radius: float

    @property
    def caption(self) -> str:
        return caption(self.shape, self.colour, self.direction, self.background)


def caption(shape: str, colour: str, direction: str, background: str) -> str:
    """'a red circle moves left on a black background' / 'a red circle stays still on a ...'."""
    motion = "stays still" if direction == "still" else f"moves {direction}"
    return f"a {colour} {shape} {motion} on a {background} background"


def parse_caption(prompt: str) -> dict[str, str | None]:
    """The attributes a prompt names (shape, colour, direction, background), None where it names none.

    The background is the colour word directly before 'background'; the object colour is the first
    foreground colour word. Words outside the vocabulary are ignored.
    """
    words = prompt.lower().replace(",", " ").replace(".", " ").split()
    found: dict[str, str | None] = dict.fromkeys(("shape", "colour", "direction", "background"))
    for i, word in enumerate(words):
        if word in BACKGROUNDS and i + 1 < len(words) and words[i + 1] == "background":
            found["background"] = word
        elif word in COLOURS and found["colour"] is None:
            found["colour"] = word
        elif word in SHAPES and found["shape"] is None:
            found["shape"] = word
        elif word in DIRECTIONS and found["direction"] is None:
            found["direction"] = word
    return found


def sample_scene(rng: np.random.Generator, split: str = "train") -> Scene:
    """A random scene; split 'train' never returns a HELD_OUT triple, 'held_out' returns only those."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split = {split!r}; allowed: 'train', 'held_out'")
    held = set(HELD_OUT)
    while True:
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = tuple(COLOURS)[rng.integers(len(COLOURS))]
        direction = tuple(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
        if ((shape, colour, direction) in held) == (split == "held_out"):
            break
    background = tuple(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    return _place(rng, shape, colour, direction, background)


def _place(rng: np.random.Generator, shape: str, colour: str, direction: str, background: str) -> Scene:
    radius = float(rng.uniform(*RADIUS))
    dx, dy = DIRECTIONS[direction]
    # The whole path stays inside the frame: the middle is at least radius + half the travel from the edge.
    margins = [radius + TRAVEL / 2 * abs(d) for d in (dx, dy)]
    centre = tuple(float(rng.uniform(m, 1 - m)) for m in margins)
    return Scene(shape, colour, direction, background, centre, radius)  # type: ignore[arg-type]


def held_out_scenes(count: int = 24, seed: int = 0) -> list[Scene]:
    """`count` scenes cycling through HELD_OUT triples and backgrounds, geometry from `seed`."""
    rng = np.random.default_rng(seed)
    backgrounds = tuple(BACKGROUNDS)
    scenes = []
    for i in range(count):
        shape, colour, direction = HELD_OUT[i % len(HELD_OUT)]
        background = backgrounds[(i + i // len(HELD_OUT)) % len(backgrounds)]
        scenes.append(_place(rng, shape, colour, direction, background))
    return scenes


def held_out_prompts(count: int = 24) -> list[str]:
    return [s.caption for s in held_out_scenes(count)]


def scene_parameters(scenes: list[Scene], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Scenes -> the tensors render_batch takes (indices into the vocab tuples, geometry as float32)."""

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return {
        "shape": column([SHAPES.index(s.shape) for s in scenes], torch.int64),
        "colour": column([COLOURS[s.colour] for s in scenes], torch.float32),
        "background": column([BACKGROUNDS[s.background] for s in scenes], torch.float32),
        "velocity": column([DIRECTIONS[s.direction] for s in scenes], torch.float32),
        "centre": column([s.centre for s in scenes], torch.float32),
        "radius": column([s.radius for s in scenes], torch.float32),
    }


def render_batch(params: dict[str, torch.Tensor], *, size: int, num_frames: int) -> torch.Tensor:
    """scene_parameters (N scenes) -> float32 frames [N, T, H, W, 3] in 0..255 (uint8 values after rounding)."""
    device = params["radius"].device
    n = params["radius"].shape[0]
    # Sub-pixel sample positions in frame fractions, [S] along one axis (S = size * SUPERSAMPLE).
    axis = (torch.arange(size * SUPERSAMPLE, device=device, dtype=torch.float32) + 0.5) / (size * SUPERSAMPLE)
    progress = torch.linspace(-0.5, 0.5, num_frames, device=device)  # the clip's middle is at 0
    centre = params["centre"][:, None, :] + TRAVEL * progress[None, :, None] * params["velocity"][:, None, :]
    r = params["radius"][:, None, None, None]
    u = (axis[None, None, None, :] - centre[..., 0, None, None]) / r  # [N, T, 1, S]
    v = (axis[None, None, :, None] - centre[..., 1, None, None]) / r  # [N, T, S, 1]
    u, v = torch.broadcast_tensors(u, v)
    inside = torch.stack(
        [
            u * u + v * v <= 1.0,  # circle
            torch.maximum(u.abs(), v.abs()) <= 0.82,  # square
            (v <= 0.5) & (v >= -1.0 + math.sqrt(3.0) * u.abs()),  # triangle, apex up
            _inside_star(u, v),
        ]
    )  # [4, N, T, S, S]
    mask = inside[params["shape"], torch.arange(n, device=device)].float()
    coverage = torch.nn.functional.avg_pool2d(mask.flatten(0, 1)[:, None], SUPERSAMPLE)[:, 0]
    coverage = coverage.view(n, num_frames, size, size, 1)
    fg = params["colour"][:, None, None, None, :]
    bg = params["background"][:, None, None, None, :]
    return (bg + (fg - bg) * coverage).round()


def _inside_star(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Five points, one straight up: the boundary radius runs linearly from 1 at a point to 0.45 between points.
    angle = torch.atan2(v, u) + math.pi / 2
    phase = torch.remainder(angle * 5 / (2 * math.pi), 1.0)
    boundary = 0.45 + 0.55 * (2 * (phase - 0.5).abs())
    return u * u + v * v <= boundary * boundary


def render(scene: Scene, *, size: int = 48, num_frames: int = 9) -> np.ndarray:
    """One scene -> uint8 frames [T, H, W, 3] (on the CPU)."""
    frames = render_batch(scene_parameters([scene]), size=size, num_frames=num_frames)[0]
    return frames.to(torch.uint8).numpy()
