"""The memory side of a Wan pipeline call: its plan, its sizes, and the decode modes a plan picks.

- `resolve_plan`: the request's MemoryPlan: from the budget planner when a GPU budget is given,
  else the chosen offload mode with the request's own CFG / FFN-chunk / decode choices;
- `model_sizes` / `workload`: what the planner estimates from (the loaded modules, the request);
- `decode_latents`: the VAE decode under a plan's decode mode. 'full' is the VAE's own decode;
  'frames' runs the same causal per-latent-frame decoder calls and turns each chunk into uint8 on
  the host as soon as it leaves the decoder, so the whole float video never exists on the device
  (exact: every value is computed by the same ops in the same order); 'bands2' / 'bands4' /
  'bands8' decode that many spatial bands with halos covering the decoder's receptive field
  (mmgen.parallel.vae_decode: exact up to the rounding of differently shaped convs; the
  full-resolution working set divided by the band count), one after another on one process, spread
  over the ranks on several (each band's work the same: the same bits on any number of ranks);
  'tiled' is diffusers' spatial tiling (lossy: overlapping tiles are blended), declared as lossy in the plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from mmgen.layers.causal_conv import causal_conv_count
from mmgen.layers.fp8_linear import fp8_block_bytes
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.vae_decode import spread_bands
from mmgen.placement.policy import (
    DECODE_BANDS,
    GIB,
    MemoryPlan,
    ModelSizes,
    Workload,
    check_budget,
    check_offload,
    plan_memory,
    stage_peaks,
)
from mmgen.placement.tensors import module_bytes
from pipelines.common import video_to_uint8


def model_sizes(
    experts: tuple[Any, ...], text_encoder: Any, vae: Any, fp8_layers: frozenset[str] = frozenset()
) -> ModelSizes:
    """Bytes and widths of a pipeline's loaded modules (wherever their weights are now); fp8_layers: the
    FP8 linear kinds the request runs (their weight copies are counted with offload none)."""
    config = experts[0].config
    return ModelSizes(
        expert_bytes=tuple(module_bytes(e) for e in experts),
        block_bytes=module_bytes(experts[0].blocks[0]),
        blocks=len(experts[0].blocks),
        text_encoder_bytes=module_bytes(text_encoder),
        vae_bytes=module_bytes(vae),
        dim=config.dim,
        ffn_dim=config.ffn_dim,
        head_dim=config.attention_head_dim,
        dtype_bytes=experts[0].dtype.itemsize,
        text_dim=text_encoder.config.d_model,
        text_ffn_dim=text_encoder.config.d_ff,
        vae_dtype_bytes=vae.dtype.itemsize,
        vae_base_dim=int(getattr(vae.config, "base_dim", 96)),
        text_block_bytes=module_bytes(text_encoder.encoder.block[0]),
        text_blocks=len(text_encoder.encoder.block),
        fp8_bytes=fp8_copy_bytes(experts, fp8_layers),
    )


def fp8_copy_bytes(experts: tuple[Any, ...], fp8_layers: frozenset[str]) -> int:
    """Device bytes of every expert's FP8 weight copies for these linear kinds (0 for none)."""
    config = experts[0].config
    return fp8_block_bytes(config.dim, config.ffn_dim, fp8_layers) * config.num_layers * len(experts)


def workload(
    latents_shape: tuple[int, ...],
    patch: tuple[int, ...],
    *,
    guided: bool,
    text_len: int,
    size: tuple[int, int, int],
) -> Workload:
    """latents [1, C, F', H', W'] with DiT patch (pt, ph, pw), size (frames, height, width) -> Workload."""
    tokens = math.prod(n // p for n, p in zip(latents_shape[2:], patch, strict=True))
    frames, height, width = size
    return Workload(tokens, guided, text_len, frames, height, width)


def resolve_plan(
    sizes: ModelSizes,
    work: Workload,
    *,
    offload: str | None,
    gpu_memory_gb: float | None,
    cfg: str | None,
    ffn_chunk: int | None,
    decode: str | None,
    block_chunk: int | None = None,
) -> MemoryPlan:
    """The request's plan: planned within gpu_memory_gb (raises before any work when nothing fits),
    else offload (default 'none') as given; explicit cfg / ffn_chunk / block_chunk / decode override either.
    """
    budget = check_budget(gpu_memory_gb)
    if offload is not None:
        check_offload(offload)
    if budget is not None:
        planned = plan_memory(sizes, work, budget, offload=offload)
    else:
        planned = MemoryPlan(offload="none" if offload is None else offload)
    overrides = {
        name: value
        for name, value in (
            ("cfg", cfg),
            ("ffn_chunk", ffn_chunk),
            ("block_chunk", block_chunk),
            ("decode", decode),
        )
        if value is not None
    }
    if not overrides:
        return planned
    # The planner's estimate was for its own choices: dropped once the request overrides any of them.
    plan = dataclasses.replace(planned, estimate_gib=None, **overrides)
    if budget is None:
        return plan
    # The estimate of what will actually run (the overrides may not fit: the measured peaks tell).
    peaks = stage_peaks(sizes, work, plan)
    return dataclasses.replace(plan, estimate_gib=tuple((k, round(v / GIB, 3)) for k, v in peaks.items()))


@torch.no_grad()
def latent_stats(vae: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and 1 / std, each [1, z_dim, 1, 1, 1] on `device` in `dtype`.

    1 / std is taken in `dtype`, as diffusers does (decode divides by it: identical bits).
    """
    config = vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(device, dtype)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(device, dtype)
    return mean, inv_std


def decode_latents(vae: Any, z: torch.Tensor, mode: str, layout: ParallelLayout | None = None) -> np.ndarray:
    """Denormalized latents [1, z_dim, F', H', W'] in the VAE dtype -> uint8 frames [T, H, W, 3].

    layout: the ranks a bands2/4/8 decode spreads its bands over (the same bits on any number)."""
    if mode == "frames":
        return _decode_by_frames(vae, z)
    if mode in DECODE_BANDS:
        layout = ParallelLayout.single() if layout is None else layout
        return spread_bands(vae, z, DECODE_BANDS[mode], layout, video_to_uint8)
    if mode == "tiled" and _tiles(vae, z):
        # What vae.decode does with tiling enabled, called directly: nothing switched on the VAE.
        return video_to_uint8(vae.tiled_decode(z, return_dict=False)[0])
    return video_to_uint8(vae.decode(z, return_dict=False)[0])


def _tiles(vae: Any, z: torch.Tensor) -> bool:
    """Whether diffusers' AutoencoderKLWan decodes latents z [B, C, F, H, W] in tiles once tiling is on:
    its own rule (_decode), a side longer than one tile."""
    ratio = vae.spatial_compression_ratio
    return (
        z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio
    )


def _decode_by_frames(vae: Any, z: torch.Tensor) -> np.ndarray:
    """AutoencoderKLWan._decode's loop (its causal caches, one latent frame per call), each output chunk
    clamped and converted to uint8 on the host at once instead of concatenated. The caches are this
    call's own list: the same loop for mmgen's decoder and diffusers' VAE (same submodule calls)."""
    cache: list[Any] = [None] * causal_conv_count(vae.decoder)
    chunks = []
    x = vae.post_quant_conv(z)
    for index in range(x.shape[2]):
        out = vae.decoder(x[:, :, index : index + 1], feat_cache=cache, feat_idx=[0], first_chunk=index == 0)
        if vae.config.patch_size is not None:  # the Wan2.2 TI2V VAE: diffusers' only
            # diffusers takes ~2 s to import: kept off the request checks' path
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)
        chunks.append(video_to_uint8(torch.clamp(out, min=-1.0, max=1.0)))
    return np.concatenate(chunks)
