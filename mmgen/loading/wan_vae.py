"""mmgen's Wan2.1 VAE decoder (mmgen.models.wan_vae) from a diffusers-format vae/ directory.

The decoder's parameters carry diffusers' AutoencoderKLWan names, so the same
diffusion_pytorch_model*.safetensors loads; the encoder's tensors (encoder.*, quant_conv.*) are
skipped. Which loader a directory's VAE gets is decided by the caller (mmgen.loading.diffusers_dir).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_tensors
from mmgen.models.wan_vae import WanVAEConfig, WanVAEDecoder

ENCODER_PREFIXES = ("encoder.", "quant_conv.")


def build_wan_vae_decoder(
    config: WanVAEConfig,
    tensors: dict[str, tuple[torch.Tensor, Path]],
    *,
    source: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    rename: Callable[[str], str | None] = lambda name: name,
) -> WanVAEDecoder:
    """A WanVAEDecoder (eval) holding `tensors` (diffusers' names after `rename`; encoder ones dropped)."""
    with torch.device("meta"):
        decoder = WanVAEDecoder(config)

    def decoder_name(key: str) -> str | None:
        name = rename(key)
        return None if name is None or name.startswith(ENCODER_PREFIXES) else name

    load_into_module(decoder, tensors, source=source, dtype=dtype, device=device, rename=decoder_name)
    return decoder.eval().requires_grad_(False)


def load_wan_vae_decoder(
    directory: Path, config: WanVAEConfig, *, dtype: torch.dtype, device: str | torch.device
) -> WanVAEDecoder:
    """The decoder of a vae/ directory whose config.json `fits` mmgen.models.wan_vae."""
    directory = Path(directory)
    tensors = read_tensors(find_weight_files(directory))
    return build_wan_vae_decoder(config, tensors, source=directory, dtype=dtype, device=device)
