"""The Wan2.1 VAE's decoder: latents [B, z_dim, F', H', W'] -> video [B, 3, T, H, W] in [-1, 1].

Written here so a Wan text-to-video run decodes without importing diffusers (~2.5 s on a 2-core
CPU). Architecture (Wan2.1 "Wan-VAE", as diffusers' AutoencoderKLWan builds its decoder, same
parameter names so the same vae/ checkpoint loads): a 1x1x1 post-quant conv; conv_in; a mid block
(residual, single-head spatial attention, residual); up blocks of residual blocks, each but the
last ending in a 2x nearest upsample (+ a causal temporal conv doubling the frames where the
encoder halved them); RMS norm, SiLU, conv_out. Every 3-tap temporal conv is causal: the decode
runs one latent frame per call and each such conv keeps its last two input frames in a per-decode
cache list (`cache`, one slot per causal conv, filled in call order; `index` is the cursor).

The ops and their order are diffusers', so fp32 outputs are bit-identical to AutoencoderKLWan's
decode on the same machine (tests/test_wan_vae.py). Only the Wan2.1 layout is written here
(`fits`): the Wan2.2 TI2V VAE (is_residual, patch_size) and every encode stay with diffusers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.layers.causal_conv import CACHE_T, CausalConv3d, cached_conv, causal_conv_count

CLASS_NAME = "AutoencoderKLWan"
FIRST_CALL = "first"  # an upsample3d slot before its first frame (that frame is not doubled)
# The Wan2.1 VAE's per-channel latent statistics (Wan's released values; AutoencoderKLWan's defaults).
WAN21_LATENTS_MEAN = (
    *(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508),
    *(0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
)
WAN21_LATENTS_STD = (
    *(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743),
    *(3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160),
)
# AutoencoderKLWan config keys that do not shape the decoder, with diffusers' defaults.
ENCODER_ONLY = {"in_channels": 3, "attn_scales": [], "dropout": 0.0}


@dataclass(frozen=True)
class WanVAEConfig:
    """AutoencoderKLWan's config (its names and defaults) as far as the decoder reads it."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: Sequence[int] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: Sequence[bool] = (False, True, True)
    latents_mean: Sequence[float] = WAN21_LATENTS_MEAN
    latents_std: Sequence[float] = WAN21_LATENTS_STD
    out_channels: int = 3
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 8
    # Always these here (`fits`); read by code shared with diffusers' VAE.
    is_residual: bool = False
    patch_size: int | None = None

    def to_diffusers(self, **encoder: Any) -> dict[str, Any]:
        """Every AutoencoderKLWan argument (as its config.json holds them); `encoder`: ENCODER_ONLY values."""
        values = {key: list(v) if isinstance(v, tuple) else v for key, v in dataclasses.asdict(self).items()}
        return {**ENCODER_ONLY, **values, **encoder}


FIELDS = {field.name: field for field in dataclasses.fields(WanVAEConfig)}


def fits(config: Mapping[str, Any]) -> bool:
    """Whether a vae/config.json (a dict) is a Wan2.1-layout AutoencoderKLWan this decoder computes."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        return False
    if config.get("is_residual", False) or config.get("patch_size") is not None:
        return False
    return all(key.startswith("_") or key in FIELDS or key in ENCODER_ONLY for key in config)


def read_config(config: Mapping[str, Any]) -> WanVAEConfig:
    """A WanVAEConfig from a config dict that `fits` (absent keys: the defaults). Lists stay lists, as
    diffusers' config holds them (code that reads either VAE's config compares them as such)."""
    return WanVAEConfig(**{key: config[key] for key in FIELDS if key in config})


class RMSNorm(nn.Module):
    """x / ||x|| over channels (dim 1) * sqrt(dim) * gamma; fp16/bf16 normalized in fp32."""

    def __init__(self, dim: int, images: bool = True) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16) or "float8_" in str(x.dtype)
        normalized = F.normalize(x.float() if low else x, dim=1).to(x.dtype)
        return normalized * self.scale * self.gamma + 0.0  # + 0.0: diffusers' zero bias (-0.0 -> 0.0)


class Upsample(nn.Upsample):
    """Nearest-exact upsampling computed in fp32, returned in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


class Resample(nn.Module):
    """2x spatial upsample + 3x3 conv to dim // 2 channels; 'upsample3d' first doubles the frames
    (a causal temporal conv to 2 * dim channels, interleaved as two frames per input frame)."""

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.resample = nn.Sequential(
            Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), nn.Conv2d(dim, dim // 2, 3, padding=1)
        )
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x: torch.Tensor, cache: list[Any], index: list[int]) -> torch.Tensor:
        b, c, t, h, w = x.size()
        if self.mode == "upsample3d":
            slot = index[0]
            if cache[slot] is None:  # the first latent frame decodes to one frame
                cache[slot] = FIRST_CALL
            else:
                keep = x[:, :, -CACHE_T:].clone()
                first = isinstance(cache[slot], str)
                if keep.shape[2] < CACHE_T:
                    before = torch.zeros_like(keep) if first else cache[slot][:, :, -1:].to(keep.device)
                    keep = torch.cat([before, keep], dim=2)
                x = self.time_conv(x) if first else self.time_conv(x, cache[slot])
                cache[slot] = keep
                x = x.reshape(b, 2, c, t, h, w)
                x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
            index[0] += 1
        t = x.shape[2]
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


class ResidualBlock(nn.Module):
    """(RMS norm, SiLU, causal 3x3x3 conv) twice, plus a 1x1x1 shortcut where the width changes."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.nonlinearity = nn.SiLU()
        self.norm1 = RMSNorm(in_dim, images=False)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim, images=False)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: list[Any], index: list[int]) -> torch.Tensor:
        shortcut = self.conv_shortcut(x)
        x = cached_conv(self.conv1, self.nonlinearity(self.norm1(x)), cache, index)
        x = cached_conv(self.conv2, self.nonlinearity(self.norm2(x)), cache, index)
        return x + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over the positions of each frame (1x1 conv projections)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        b, c, t, h, w = x.size()
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        qkv = self.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = self.proj(x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int]) -> torch.Tensor:
        x = self.resnets[0](x, feat_cache, feat_idx)
        return self.resnets[1](self.attentions[0](x), feat_cache, feat_idx)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, mode: str | None) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(ResidualBlock(d, out_dim) for d in dims)
        self.upsamplers = nn.ModuleList([Resample(out_dim, mode)]) if mode else None

    def forward(
        self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int], first_chunk: bool = False
    ) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, feat_cache, feat_idx)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, feat_cache, feat_idx)
        return x


class Decoder(nn.Module):
    """One latent frame per call: x [B, z_dim, 1, H', W'] -> [B, 3, 1 or scale_t, H, W] (causal caches)."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        dim = config.decoder_base_dim or config.base_dim
        mult = list(config.dim_mult)
        dims = [dim * u for u in [mult[-1], *mult[::-1]]]
        temporal = list(config.temperal_downsample)[::-1]
        self.nonlinearity = nn.SiLU()
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            # After the first block the input is the previous upsample's output: half its width.
            in_dim = in_dim // 2 if i > 0 else in_dim
            mode = None if i == len(mult) - 1 else ("upsample3d" if temporal[i] else "upsample2d")
            self.up_blocks.append(UpBlock(in_dim, out_dim, config.num_res_blocks, mode))
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3, padding=1)

    def forward(
        self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int], first_chunk: bool = False
    ) -> torch.Tensor:
        x = cached_conv(self.conv_in, x, feat_cache, feat_idx)
        x = self.mid_block(x, feat_cache, feat_idx)
        for block in self.up_blocks:
            x = block(x, feat_cache, feat_idx, first_chunk=first_chunk)
        return cached_conv(self.conv_out, self.nonlinearity(self.norm_out(x)), feat_cache, feat_idx)


class WanVAEDecoder(nn.Module):
    """The decode half of AutoencoderKLWan (post_quant_conv + decoder), with its decode / tiled_decode."""

    def __init__(self, config: WanVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)
        self.spatial_compression_ratio = config.scale_factor_spatial
        # diffusers' tile sizes (pixels) for tiled_decode.
        self.tile_sample_min_height = self.tile_sample_min_width = 256
        self.tile_sample_stride_height = self.tile_sample_stride_width = 192

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @torch.no_grad()
    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        """Denormalized latents z [B, z_dim, F', H', W'] -> (video [B, 3, T, H, W] clamped to [-1, 1],)."""
        if return_dict:
            raise ValueError("WanVAEDecoder.decode returns a tuple: pass return_dict=False")
        return (torch.clamp(self._frames(self.post_quant_conv(z)), min=-1.0, max=1.0),)

    def _frames(self, x: torch.Tensor) -> torch.Tensor:
        cache: list[Any] = [None] * causal_conv_count(self.decoder)
        out = []
        for frame in range(x.shape[2]):
            out.append(self.decoder(x[:, :, frame : frame + 1], cache, [0], first_chunk=frame == 0))
        return torch.cat(out, 2)

    @torch.no_grad()
    def tiled_decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        """diffusers' tiled decode (lossy): overlapping spatial tiles decoded apart, the overlaps blended
        linearly, for latents whose sides exceed one tile."""
        if return_dict:
            raise ValueError("WanVAEDecoder.tiled_decode returns a tuple: pass return_dict=False")
        ratio = self.spatial_compression_ratio
        height, width = z.shape[3], z.shape[4]
        tile_h, tile_w = self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        step_h, step_w = self.tile_sample_stride_height // ratio, self.tile_sample_stride_width // ratio
        keep_h, keep_w = self.tile_sample_stride_height, self.tile_sample_stride_width
        blend_h, blend_w = self.tile_sample_min_height - keep_h, self.tile_sample_min_width - keep_w
        rows = [
            [
                self._frames(self.post_quant_conv(z[:, :, :, i : i + tile_h, j : j + tile_w]))
                for j in range(0, width, step_w)
            ]
            for i in range(0, height, step_h)
        ]
        out_rows = []
        for i, row in enumerate(rows):
            kept = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = _blend(rows[i - 1][j], tile, blend_h, axis=3)
                if j > 0:
                    tile = _blend(row[j - 1], tile, blend_w, axis=4)
                kept.append(tile[:, :, :, :keep_h, :keep_w])
            out_rows.append(torch.cat(kept, dim=-1))
        video = torch.cat(out_rows, dim=3)[:, :, :, : height * ratio, : width * ratio]
        return (torch.clamp(video, min=-1.0, max=1.0),)


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, axis: int) -> torch.Tensor:
    """b's first `extent` rows along `axis` (3: H, 4: W) faded in over a's last ones (b changed in place)."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    for y in range(extent):
        b.select(axis, y).copy_(
            a.select(axis, y - extent) * (1 - y / extent) + b.select(axis, y) * (y / extent)
        )
    return b
