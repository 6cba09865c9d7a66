"""The Wan VAE decode split over the ranks of a layout: spatial bands with a recomputed halo (exact).

Why spatial bands and not time chunks. diffusers' AutoencoderKLWan decodes one latent frame per call,
each causal 3-tap temporal conv reading its cached inputs of the two frames before. A chunk of frames
decoded from a fresh cache is exact only if its caches hold what the earlier frames left there, and
the decoder's temporal receptive field is longer than a whole video (Wan2.1 VAE: 12 causal convs at
the latent rate alone look back 24 latent frames; an 81-frame video has 21): an exact time split has
to hand the caches over chunk after chunk, which is a sequential decode with extra traffic.

Spatially, only the start of the decoder mixes a whole frame: `conv_in` and the mid block (whose
attention attends every position of a frame) run on the whole frame on every rank; they work at the
latent resolution, a few percent of the decode. Everything after them (the up blocks and the head)
is local along height and width: 3x3 convs, per-position RMS norms, nearest upsampling, temporal
convs of spatial size 1. Each rank runs them on its band of the longer latent axis plus a halo as
wide as their receptive field from that point on (`decoder_halos`, from the modules themselves).
The outer halo rows are wrong (zero-padded where the band, not the frame, ends), but the error moves
inward one row per conv and never reaches the band; the temporal caches store each conv's *inputs*,
so it does not grow from frame to frame either. After each up block the halo is trimmed to what the
rest needs, so the expensive full-resolution stages carry a few pixels of halo, not 13 latent rows.

Every output value is computed by the same ops from the same inputs as in the one-process decode:
equal up to the rounding of differently shaped convs (fp32: ~1e-7), uint8 frames identical in the
tests. Each rank turns its band into frames as it goes; the bands are gathered on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmgen.errors import ValidationError
from mmgen.layers.causal_conv import cached_conv, causal_conv_count
from mmgen.parallel.layout import ParallelLayout

# Frames -> numpy [T, H, W, C]: how the caller turns a decoded [1, C, T, H, W] chunk into frames.
Convert = Callable[[torch.Tensor], np.ndarray]


@dataclass(frozen=True)
class DecodeBands:
    """How a decode of latents [1, C, F', H', W'] is split: bands of latent `axis` (3 = H', 4 = W').

    bands[r] = (start, end) latent positions of rank r (even split, the first ranks one larger);
    halos[j] = rows of halo at the input of up block j (its own resolution), halos[-1] at the head;
    scales[j] = resolution of up block j's input relative to the latents, scales[-1] at the head;
    pixels = output pixels per latent position along the axis (scales[-1] x the VAE's patch size).
    """

    axis: int
    length: int
    bands: tuple[tuple[int, int], ...]
    halos: tuple[int, ...]
    scales: tuple[int, ...]
    pixels: int

    def work_fraction(self, rank: int) -> float:
        """The share of the one-process up-block rows rank computes at full resolution (halo included)."""
        start, end = self.bands[rank]
        scale, halo = self.scales[-1], self.halos[-1]
        return (min(self.length * scale, end * scale + halo) - max(0, start * scale - halo)) / (
            self.length * scale
        )


def plan_bands(vae: Any, latents_shape: tuple[int, ...], ranks: int) -> DecodeBands:
    """Split latents [1, C, F', H', W'] into `ranks` bands of the longer spatial axis for `vae`'s decoder.

    The axis must have at least `ranks` positions (split_decode decodes whole frames otherwise).
    """
    axis = 4 if latents_shape[4] >= latents_shape[3] else 3
    length = int(latents_shape[axis])
    if length < ranks:
        raise ValidationError(f"split VAE decode: {length} latent positions do not split over {ranks} ranks")
    sizes = [length // ranks + (r < length % ranks) for r in range(ranks)]
    starts = [sum(sizes[:r]) for r in range(ranks)]
    halos, scales = decoder_halos(vae.decoder, axis)
    pixels = scales[-1] * (vae.config.patch_size or 1)
    bands = tuple((s, s + n) for s, n in zip(starts, sizes, strict=True))
    return DecodeBands(axis, length, bands, halos, scales, pixels)


def decoder_halos(decoder: nn.Module, axis: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Halo rows each up block's input needs (and the head's), and their scales, read from the modules.

    Walks the stages backwards from the output: a conv of radius r adds r rows; an upsample by f
    maps R rows to ceil(R / f) rows of its input. Residual shortcuts add no radius (1x1 convs or
    pixel-local rearrangements), so the main path bounds each block. Any attention after the mid
    block would make the split inexact: refused.
    """
    # Each stage's modules in registration (= forward) order: the up blocks, then the head.
    stages = [list(block.modules()) for block in decoder.up_blocks] + [[decoder.norm_out, decoder.conv_out]]
    factors = []
    for stage in stages:
        factor = 1
        for module in stage:
            if "Attention" in type(module).__name__:
                raise ValidationError(
                    f"split VAE decode: {type(module).__name__} after the mid block mixes whole frames; "
                    "decode on one rank"
                )
            if isinstance(module, nn.Upsample):
                factor *= _upsample_factor(module, axis)
        factors.append(factor)
    halos = [0] * len(stages)
    radius = 0
    for index in range(len(stages) - 1, -1, -1):
        for module in reversed(stages[index]):
            if isinstance(module, nn.Upsample):
                radius = -(-radius // _upsample_factor(module, axis))
            elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
                radius += _conv_radius(module, axis)
        halos[index] = radius
    scales = [math.prod(factors[:index]) for index in range(len(stages))]
    return tuple(halos), tuple(scales)


def _upsample_factor(module: nn.Upsample, axis: int) -> int:
    factor = module.scale_factor
    factor = factor[axis - 5] if isinstance(factor, tuple) else factor
    if factor is None or float(factor) != int(factor):
        raise ValidationError(f"split VAE decode: upsample factor {module.scale_factor} is not an integer")
    return int(factor)


def _conv_radius(conv: nn.Conv2d | nn.Conv3d, axis: int) -> int:
    kernel, stride, dilation = conv.kernel_size[axis - 5], conv.stride[axis - 5], conv.dilation[axis - 5]
    if stride != 1 or kernel % 2 == 0:
        raise ValidationError(
            f"split VAE decode: conv kernel {conv.kernel_size} stride {conv.stride} is not a same-size conv"
        )
    return dilation * (kernel - 1) // 2


@torch.no_grad()
def decode_band(vae: Any, z: torch.Tensor, plan: DecodeBands, rank: int, convert: Convert) -> np.ndarray:
    """Denormalized latents z [1, C, F', H', W'] -> rank's band of the frames, convert()ed chunk by chunk.

    The loop of AutoencoderKLWan._decode (one latent frame per call, causal caches), with conv_in and
    the mid block on the whole frame and the rest on the band plus its halo; `vae` is mmgen's Wan
    decoder or diffusers' AutoencoderKLWan (the same submodules). The caches are this call's own list.
    """
    decoder = vae.decoder
    cache: list[Any] = [None] * causal_conv_count(decoder)
    x = vae.post_quant_conv(z)
    chunks = []
    for frame in range(x.shape[2]):
        index = [0]
        h = cached_conv(decoder.conv_in, x[:, :, frame : frame + 1], cache, index)
        h = decoder.mid_block(h, feat_cache=cache, feat_idx=index)
        covered = (0, plan.length)
        for block_index, block in enumerate(decoder.up_blocks):
            scale = plan.scales[block_index]
            h, covered = _trim(h, covered, plan, rank, scale, plan.halos[block_index])
            h = block(h, feat_cache=cache, feat_idx=index, first_chunk=frame == 0)
            factor = plan.scales[block_index + 1] // scale
            covered = (covered[0] * factor, covered[1] * factor)
        h, covered = _trim(h, covered, plan, rank, plan.scales[-1], plan.halos[-1])
        h = cached_conv(decoder.conv_out, decoder.nonlinearity(decoder.norm_out(h)), cache, index)
        h, _ = _trim(h, covered, plan, rank, plan.scales[-1], 0)
        if vae.config.patch_size is not None:  # the Wan2.2 TI2V VAE: diffusers' only
            # diffusers takes ~2 s to import: kept off the request checks' path
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            h = unpatchify(h, patch_size=vae.config.patch_size)
        chunks.append(convert(torch.clamp(h, min=-1.0, max=1.0)))
    return np.concatenate(chunks)


def _trim(
    h: torch.Tensor, covered: tuple[int, int], plan: DecodeBands, rank: int, scale: int, halo: int
) -> tuple[torch.Tensor, tuple[int, int]]:
    """h covers rows [covered) of plan.axis at `scale` x the latents' resolution; keep rank's band
    there plus `halo` rows each side, within the frame."""
    start, end = plan.bands[rank]
    low, high = max(0, start * scale - halo), min(plan.length * scale, end * scale + halo)
    if low < covered[0] or high > covered[1]:
        raise AssertionError(f"band rows [{low}, {high}) outside the computed [{covered[0]}, {covered[1]})")
    return h.narrow(plan.axis, low - covered[0], high - low).contiguous(), (low, high)


def split_decode(vae: Any, z: torch.Tensor, layout: ParallelLayout, convert: Convert) -> np.ndarray:
    """Denormalized latents z [1, C, F', H', W'] (the same on every rank) -> the whole frames
    [T, H, W, C] on every rank, each rank decoding its band (see the module docstring): the bands
    spread_bands spreads, one a rank. One rank, or fewer latent positions than ranks: every rank
    decodes the whole frames."""
    ranks = layout.world_size
    if ranks == 1 or layout.world_group is None or max(z.shape[3:]) < ranks:
        return decode_in_bands(vae, z, 1, convert)
    return spread_bands(vae, z, ranks, layout, convert)


def spread_bands(
    vae: Any, z: torch.Tensor, bands: int, layout: ParallelLayout, convert: Convert
) -> np.ndarray:
    """The decode of `bands` spatial bands (the bands2/4/8 modes) spread over the layout's ranks: each
    rank decodes a contiguous run of the bands, gathered on every rank. The plan and each band's work
    are decode_in_bands(vae, z, bands)'s on one process, so the frames have its bits on any number of
    ranks (unlike `split`, whose bands follow the rank count). Fewer bands than ranks: every rank
    decodes all of them (the same bits, no speed-up)."""
    plan = band_plan(vae, z, bands)
    count, ranks = len(plan.bands), layout.world_size
    if ranks == 1 or layout.world_group is None or count < ranks:
        return decode_in_bands(vae, z, plan, convert)
    groups = [range(r * count // ranks, (r + 1) * count // ranks) for r in range(ranks)]
    mine = np.concatenate(
        [decode_band(vae, z, plan, band, convert) for band in groups[layout.rank]], axis=plan.axis - 2
    )
    return gather_bands(mine, [_width(plan, group) for group in groups], plan.axis - 2, layout)


def band_plan(vae: Any, z: torch.Tensor, bands: int) -> DecodeBands:
    """The plan of a `bands`-band decode of z: fewer bands where the latents have fewer positions."""
    return plan_bands(vae, tuple(z.shape), max(1, min(bands, max(z.shape[3:]))))


def decode_in_bands(vae: Any, z: torch.Tensor, bands: int | DecodeBands, convert: Convert) -> np.ndarray:
    """Denormalized latents z [1, C, F', H', W'] -> frames [T, H, W, C], decoded as `bands` spatial
    bands (a count, or a plan_bands plan) one after another in this process (the split decode's bands
    and halos): the decoder's full-resolution working set is about 1/bands of the whole frame's.
    Fewer latent positions than bands: fewer bands."""
    plan = bands if isinstance(bands, DecodeBands) else band_plan(vae, z, bands)
    parts = [decode_band(vae, z, plan, band, convert) for band in range(len(plan.bands))]
    return np.concatenate(parts, axis=plan.axis - 2)  # [1, C, T, H, W] axis -> [T, H, W, C] axis


def _width(plan: DecodeBands, bands: Sequence[int]) -> int:
    """Output pixels along plan.axis of these bands."""
    return sum((plan.bands[b][1] - plan.bands[b][0]) * plan.pixels for b in bands)


def gather_bands(part: np.ndarray, widths: Sequence[int], axis: int, layout: ParallelLayout) -> np.ndarray:
    """Each rank's frames [T, H, w_r, C] (or [T, h_r, W, C]: widths[r] along `axis`) -> the whole frames
    on every rank."""
    local = torch.from_numpy(np.ascontiguousarray(part)).to(layout.collective_device)
    pad = [0, 0] * (local.dim() - axis - 1) + [0, max(widths) - local.shape[axis]]
    local = torch.nn.functional.pad(local, pad) if pad[-1] else local
    parts = [torch.empty_like(local) for _ in widths]
    dist.all_gather(parts, local, group=layout.world_group)
    whole = torch.cat([part.narrow(axis, 0, width) for part, width in zip(parts, widths, strict=True)], axis)
    return whole.cpu().numpy()
