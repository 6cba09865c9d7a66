"""mmgen's Wan2.1 VAE decoder (mmgen.models.wan_vae) against diffusers' AutoencoderKLWan.

Tiny random configs (fp32; the same conv shapes on both sides, compared with a 1e-5 tolerance that
covers other CPUs' kernels), the tiled decode, and the embedded default model's real weights, whose
uint8 frames must be those of diffusers' decode (the model's frames SHA depends on them). The loader
gives a text-to-video directory mmgen's decoder and an image-to-video one diffusers' VAE (it encodes).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmgen.loading.diffusers_dir import load_vae, load_wan_components
from mmgen.loading.wan_vae import load_wan_vae_decoder
from mmgen.models.wan_vae import WanVAEDecoder, fits, read_config
from pipelines.common import video_to_uint8

diffusers = pytest.importorskip("diffusers")

CONFIGS = {
    # two spatial ups, the second with a temporal one (the default model's layout)
    "2x-temporal": dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True]
    ),
    # three ups, two temporal, two residual blocks per stage (Wan2.1's layout at a tiny width)
    "wan21-shape": dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=2, temperal_downsample=[False, True, True]
    ),
}


def random_pair(config: dict) -> tuple[torch.nn.Module, WanVAEDecoder]:
    """diffusers' VAE with seeded random weights (nonzero norms and biases) and mmgen's decoder holding them."""
    torch.manual_seed(0)
    reference = diffusers.AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0.0, 0.2)
    own = WanVAEDecoder(read_config(dict(reference.config))).eval()
    decoder_state = {
        k: v for k, v in reference.state_dict().items() if not k.startswith(("encoder.", "quant_conv."))
    }
    own.load_state_dict(decoder_state, strict=True)
    return reference, own


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("frames", [1, 4])
def test_decode_matches_diffusers(name, frames):
    reference, own = random_pair(CONFIGS[name])
    assert fits(dict(reference.config))
    z = torch.randn(1, 4, frames, 6, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.decode(z, return_dict=False)[0]
        got = own.decode(z)[0]
    assert got.shape == expected.shape and expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_tiled_decode_matches_diffusers():
    reference, own = random_pair(CONFIGS["2x-temporal"])
    reference.enable_tiling(32, 32, 24, 24)  # pixels: tiles of 8 latents, stride 6
    own.tile_sample_min_height = own.tile_sample_min_width = 32
    own.tile_sample_stride_height = own.tile_sample_stride_width = 24
    z = torch.randn(1, 4, 2, 10, 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.tiled_decode(z, return_dict=False)[0]
        got = own.tiled_decode(z)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_default_model_frames_equal_diffusers(default_model_dir):
    directory = default_model_dir / "vae"
    config = json.loads((directory / "config.json").read_text())
    own = load_wan_vae_decoder(directory, read_config(config), dtype=torch.float32, device="cpu")
    reference = diffusers.AutoencoderKLWan.from_pretrained(str(directory)).eval()
    z = torch.randn(1, 8, 5, 12, 12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.decode(z, return_dict=False)[0]
        got = own.decode(z)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # The same ops in the same order on one machine: the frames are the same bytes.
    assert (video_to_uint8(got) == video_to_uint8(expected)).all()


@pytest.mark.parametrize(
    ("change", "ours"), [({}, True), ({"is_residual": True}, False), ({"patch_size": 2}, False)]
)
def test_the_loader_decides_by_config(default_model_dir, tmp_path, change, ours):
    directory = tmp_path / "vae"
    shutil.copytree(default_model_dir / "vae", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    assert fits({**config, **change}) == ours
    if not ours:
        return  # diffusers' VAE of another layout cannot hold these weights: the decision is enough
    assert isinstance(load_vae(directory, dtype=torch.float32, device="cpu", decode_only=True), WanVAEDecoder)
    encoder = load_vae(directory, dtype=torch.float32, device="cpu", decode_only=False)
    assert isinstance(encoder, diffusers.AutoencoderKLWan)


def test_text_to_video_loads_mmgen_decoder(default_model_dir):
    components = load_wan_components(default_model_dir)
    assert isinstance(components.vae, WanVAEDecoder)
    assert components.vae.config.z_dim == components.transformer.config.in_channels


def test_config_defaults_are_diffusers():
    # A config.json that omits keys (the original layout's reader too) means AutoencoderKLWan's defaults.
    import inspect

    defaults = read_config({})
    for name, parameter in inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters.items():
        if hasattr(defaults, name) and parameter.default is not inspect.Parameter.empty:
            value = parameter.default
            assert (
                list(getattr(defaults, name)) == value
                if isinstance(value, list)
                else getattr(defaults, name) == value
            )
