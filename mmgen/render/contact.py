"""Contact sheets: a few frames as rows of baseline | candidate | absolute-difference heatmap."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmgen.errors import ValidationError
from mmgen.outputs.writers import write_png
from mmgen.render.metrics import psnr_uint8

GAP = 6
TEXT_LINE = 14
BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)


def pick_frames(num_frames: int, rows: int) -> list[int]:
    """Up to `rows` frame indices spread evenly from the first to the last frame."""
    if num_frames <= rows:
        return list(range(num_frames))
    if rows <= 1:
        return [0]
    return sorted({round(i * (num_frames - 1) / (rows - 1)) for i in range(rows)})


def heatmap(delta: np.ndarray, scale_max: int) -> np.ndarray:
    """uint8 [H, W] absolute differences -> uint8 RGB [H, W, 3]: black, red, yellow, white at scale_max."""
    x = np.clip(delta.astype(np.float32) / max(scale_max, 1), 0.0, 1.0)
    rgb = np.stack([np.clip(3 * x, 0, 1), np.clip(3 * x - 1, 0, 1), np.clip(3 * x - 2, 0, 1)], axis=-1)
    return (rgb * 255.0 + 0.5).astype(np.uint8)


def _upscale(frame: np.ndarray, factor: int) -> np.ndarray:
    # Nearest neighbour: tiny test frames become visible without inventing pixels.
    return frame.repeat(factor, axis=0).repeat(factor, axis=1) if factor > 1 else frame


def write_contact_sheet(
    base: np.ndarray, cand: np.ndarray, path: Path | str, *, title: str, rows: int = 4, min_height: int = 128
) -> Path:
    """Write a PNG comparing uint8 frames [T, H, W, 3]; each row names its frame index and PSNR."""
    if base.shape != cand.shape:
        raise ValidationError(f"{path}: contact sheet needs equal shapes, got {base.shape} and {cand.shape}")
    delta = np.abs(base.astype(np.int16) - cand.astype(np.int16)).max(axis=-1).astype(np.uint8)
    scale_max = int(delta.max())
    indices = pick_frames(base.shape[0], rows)
    height, width = base.shape[1:3]
    factor = max(1, math.ceil(min_height / height))
    panel_h, panel_w = height * factor, width * factor
    header_h = 3 * TEXT_LINE + GAP
    row_h = TEXT_LINE + GAP + panel_h + GAP
    sheet_w = max(3 * panel_w + 4 * GAP, 420)
    sheet = Image.new("RGB", (sheet_w, header_h + len(indices) * row_h), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    overall = psnr_uint8(base, cand)
    draw.text((GAP, 2), title, fill=TEXT, font=font)
    draw.text(
        (GAP, 2 + TEXT_LINE), f"all frames: PSNR {_db(overall)}, max |diff| {scale_max}", fill=TEXT, font=font
    )
    draw.text(
        (GAP, 2 + 2 * TEXT_LINE),
        f"columns: baseline | candidate | |diff| heatmap (white = {scale_max} levels)",
        fill=TEXT,
        font=font,
    )
    for row, index in enumerate(indices):
        top = header_h + row * row_h
        frame_psnr = psnr_uint8(base[index], cand[index])
        draw.text(
            (GAP, top),
            f"frame {index}   PSNR {_db(frame_psnr)}   max |diff| {int(delta[index].max())}",
            fill=TEXT,
            font=font,
        )
        panels = (base[index], cand[index], heatmap(delta[index], scale_max))
        for column, panel in enumerate(panels):
            image = Image.fromarray(np.ascontiguousarray(_upscale(panel, factor)))
            sheet.paste(image, (GAP + column * (panel_w + GAP), top + TEXT_LINE + GAP))
    return write_png(np.asarray(sheet), path)


def _db(value: float) -> str:
    return "inf (identical)" if math.isinf(value) else f"{value:.2f} dB"
