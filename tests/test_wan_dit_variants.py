"""The Wan DiT's Wan2.1 I2V / FLF2V image path and Wan2.2 TI2V per-token timesteps vs diffusers (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import save_file
from wan_cases import DIFFUSERS_TINY_DIT, diffusers_to_original_key
from wan_cases import jittered_diffusers_dit as jittered

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.errors import ValidationError
from mmgen.loading.wan_transformer import load_wan_transformer, original_to_diffusers_key
from mmgen.models.wan import WanConfig, WanDiT

I2V = {**DIFFUSERS_TINY_DIT, "in_channels": 12, "out_channels": 4, "image_dim": 24, "added_kv_proj_dim": 32}
FLF2V = {**I2V, "pos_embed_seq_len": 10}
TI2V = {**DIFFUSERS_TINY_DIT, "in_channels": 6, "out_channels": 6}
# diffusers' processor splits image tokens off the front of the context as "all but the last 512".
TEXT_LEN = 512


def mmgen_copy(reference: WanTransformer3DModel) -> WanDiT:
    config = WanConfig.from_diffusers_config(dict(reference.config))
    model = WanDiT(config).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=True)
    assert not missing and not unexpected
    return model


def inputs(channels: int, batch: int = 2, frames: int = 3, height: int = 4, width: int = 6, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, channels, frames, height, width, generator=gen)
    text = torch.randn(batch, TEXT_LEN, 32, generator=gen)
    text[:, 7:] = 0
    return latents, torch.tensor([999.0, 321.5][:batch]), text, gen


@pytest.mark.parametrize("config", [I2V, FLF2V], ids=["i2v", "flf2v"])
def test_image_path_matches_diffusers(config):
    reference = jittered(config)
    model = mmgen_copy(reference)
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    latents, timestep, text, gen = inputs(12)
    images = 2 if "pos_embed_seq_len" in config else 1  # FLF2V: first and last frame, 5 tokens each
    image = torch.randn(2 * images, 5, 24, generator=gen)
    with torch.no_grad():
        expected = reference(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
        for impl in (SDPAImpl(), FlashAttentionImpl("reference")):
            out = model(latents, timestep, text, attention=impl, image_embeds=image)
            assert out.shape == expected.shape
            assert (out - expected).abs().max().item() <= 1e-5
        # the image matters: a different image changes the output
        other = model(
            latents,
            timestep,
            text,
            attention=SDPAImpl(),
            image_embeds=torch.randn(image.shape, generator=gen),
        )
    assert (other - expected).abs().max().item() > 1e-4


def test_image_path_with_fused_projections_and_torch_row_path():
    reference = jittered(I2V)
    model = mmgen_copy(reference).fuse_projections().set_fused_kernels(False)
    latents, timestep, text, gen = inputs(12)
    image = torch.randn(2, 5, 24, generator=gen)
    with torch.no_grad():
        expected = reference(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
        out = model(latents, timestep, text, attention=SDPAImpl(), image_embeds=image)
    assert (out - expected).abs().max().item() <= 1e-5


def test_per_token_timesteps_match_diffusers():
    reference = jittered(TI2V)
    model = mmgen_copy(reference)
    latents, _, text, _ = inputs(6)
    tokens = 3 * 2 * 3
    # Wan2.2 TI2V: the first latent frame's tokens at timestep 0, the rest at t.
    mask = torch.ones(3, 2, 3)
    mask[0] = 0
    timestep = torch.stack([mask.flatten() * 999.0, mask.flatten() * 321.5])
    assert timestep.shape == (2, tokens)
    with torch.no_grad():
        expected = reference(latents, timestep, text, return_dict=False)[0]
        out = model(latents, timestep, text, attention=SDPAImpl())
        scalar = model(latents, timestep[:, -1], text, attention=SDPAImpl())
        scalar_reference = reference(latents, timestep[:, -1], text, return_dict=False)[0]
    assert (out - expected).abs().max().item() <= 1e-5
    assert (scalar - scalar_reference).abs().max().item() <= 1e-5
    assert (out - scalar).abs().max().item() > 1e-4  # the per-token path is not ignored


def test_image_inputs_checked():
    model = mmgen_copy(jittered(I2V))
    latents, timestep, text, gen = inputs(12)
    with pytest.raises(ValidationError, match="image_embeds must be"):
        model(latents, timestep, text, attention=SDPAImpl())
    with pytest.raises(ValidationError, match="image_embeds must be"):
        model(latents, timestep, text, attention=SDPAImpl(), image_embeds=torch.zeros(2, 5, 23))
    text_only = mmgen_copy(jittered(TI2V))
    latents, timestep, text, _ = inputs(6)
    with pytest.raises(ValidationError, match="no image path"):
        text_only(latents, timestep, text, attention=SDPAImpl(), image_embeds=torch.zeros(2, 5, 24))
    with pytest.raises(ValidationError, match=r"\(2, 18\) \(one per token\)"):
        text_only(latents, torch.zeros(2, 17), text, attention=SDPAImpl())
    # The text's shape is checked for a text-only model too (not only beside image tokens).
    with pytest.raises(ValidationError, match=r"text must be \[2, L, 32\], got \(2, 512, 31\)"):
        text_only(latents, timestep, text[..., :31], attention=SDPAImpl())
    with pytest.raises(ValidationError, match="set both"):
        WanConfig(image_dim=1280)


def test_presets_round_trip_through_diffusers_config():
    for preset in (WanConfig.wan21_i2v_14b(), WanConfig.wan22_i2v_a14b(), WanConfig.wan22_ti2v_5b()):
        raw = preset.to_diffusers_config()
        assert WanConfig.from_diffusers_config(raw) == preset
        with torch.device("meta"):
            reference = WanTransformer3DModel(**raw)
            model = WanDiT(preset)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert shapes == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert WanConfig.wan22_ti2v_5b().dim == 3072


def test_original_i2v_layout_loads_with_image_path(tmp_path):
    config = {**I2V, "image_dim": 1280, "added_kv_proj_dim": 32}
    reference = jittered(config)
    state = {diffusers_to_original_key(k): v.contiguous() for k, v in reference.state_dict().items()}
    assert all(original_to_diffusers_key(k) in reference.state_dict() for k in state)
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    raw = {
        "_class_name": "WanModel",
        "model_type": "i2v",
        "dim": 32,
        "ffn_dim": 64,
        "freq_dim": 32,
        "in_dim": 12,
        "out_dim": 4,
        "num_heads": 2,
        "num_layers": 2,
        "text_dim": 32,
        "eps": 1e-6,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_wan_transformer(tmp_path, dtype=torch.float32)
    assert model.config.image_dim == 1280 and model.config.added_kv_proj_dim == 32
    latents, timestep, text, gen = inputs(12)
    image = torch.randn(2, 5, 1280, generator=gen)
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl(), image_embeds=image, metadata=None)
        expected = reference(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
    assert (out - expected).abs().max().item() <= 1e-5


def test_original_wan22_configs_have_no_image_path():
    base = {"dim": 32, "ffn_dim": 64, "freq_dim": 32, "num_heads": 2, "num_layers": 2, "eps": 1e-6}
    ti2v = WanConfig.from_original_config({**base, "model_type": "ti2v", "in_dim": 48, "out_dim": 48})
    i2v = WanConfig.from_original_config({**base, "model_type": "i2v", "in_dim": 36, "out_dim": 16})
    assert (ti2v.in_channels, ti2v.image_dim) == (48, None)
    assert (i2v.in_channels, i2v.image_dim) == (36, None)  # Wan2.2 I2V: no img_emb weights
    wan21 = WanConfig.from_original_config(
        {**base, "model_type": "i2v", "in_dim": 36, "out_dim": 16}, has_image_embedding=True
    )
    assert (wan21.image_dim, wan21.added_kv_proj_dim) == (1280, 32)
    with pytest.raises(ValidationError, match="model_type 'vace'"):
        WanConfig.from_original_config({**base, "model_type": "vace", "in_dim": 16, "out_dim": 16})


def test_bf16_image_path_keeps_diffusers_fp32_modules(tmp_path):
    jittered(I2V).save_pretrained(tmp_path)
    reference = WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    model = load_wan_transformer(tmp_path, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in reference.named_parameters()}
    assert dtypes["condition_embedder.image_embedder.norm1.weight"] == torch.float32
    latents, timestep, text, gen = inputs(12)
    image = torch.randn(2, 5, 24, generator=gen)
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl(), image_embeds=image)
        expected = reference(
            latents.bfloat16(),
            timestep,
            text.bfloat16(),
            encoder_hidden_states_image=image.bfloat16(),
            return_dict=False,
        )[0]
        exact = jittered(I2V)(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[
            0
        ]
    assert out.dtype == torch.bfloat16
    # bf16 rounding apart: as close to the fp32 result as diffusers' bf16 run is (values ~1, ulp 2^-7)
    ours_error = (out.float() - exact).abs().max().item()
    reference_error = (expected.float() - exact).abs().max().item()
    assert ours_error <= 1.5 * reference_error + 2**-8, (ours_error, reference_error)
    assert (out.float() - expected.float()).abs().max().item() <= 2e-2
