"""mmgen's Wan DiT against diffusers' WanTransformer3DModel on tiny random configs (CPU, fp32, <= 1e-5)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file, save_file
from wan_cases import DIFFUSERS_TINY_DIT, diffusers_to_original_key, jittered_diffusers_dit

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.errors import LoadError, ValidationError
from mmgen.loading.wan_transformer import load_wan_transformer
from mmgen.models.wan import WanConfig

TINY = {**DIFFUSERS_TINY_DIT, "in_channels": 4, "out_channels": 4}
TEXT_LEN = 16  # the tests' stand-in for Wan's 512-token padded prompt
# (batch, latent frames, height, width, valid text tokens per prompt)
SHAPES = [
    (1, 1, 8, 12, (TEXT_LEN,)),  # one frame (text-to-image), non-square
    (1, 3, 6, 4, (7,)),  # 9 video frames -> 3 latent frames, H > W
    (2, 3, 4, 6, (5, 11)),  # batch 2, prompts of different lengths
    (2, 1, 10, 10, (16, 3)),
]


@pytest.fixture(scope="module")
def reference() -> WanTransformer3DModel:
    return jittered_diffusers_dit(TINY)


@pytest.fixture(scope="module")
def diffusers_dir(reference, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wan_diffusers")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def original_dir(reference, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wan_original")
    state = {diffusers_to_original_key(k): v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
    config = {
        "_class_name": "WanModel",
        "_diffusers_version": "0.30.0",
        "model_type": "t2v",
        "dim": 32,
        "ffn_dim": 64,
        "freq_dim": 32,
        "in_dim": 4,
        "out_dim": 4,
        "num_heads": 2,
        "num_layers": 2,
        "text_dim": 32,
        "text_len": 512,
        "eps": 1e-6,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_inputs(batch, frames, height, width, lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, frames, height, width, generator=gen)
    timestep = torch.tensor([999.0, 321.5][:batch])
    text = torch.randn(batch, TEXT_LEN, 32, generator=gen)
    for row, length in enumerate(lengths):
        text[row, length:] = 0  # Wan's prompts: zero-padded to the fixed text length
    return latents, timestep, text


def diffusers_forward(model, latents, timestep, text):
    with torch.no_grad():
        return model(latents, timestep, text, return_dict=False)[0]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_diffusers_layout_matches_diffusers(reference, diffusers_dir, shape):
    model = load_wan_transformer(diffusers_dir, dtype=torch.float32)
    latents, timestep, text = make_inputs(*shape)
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl())
    expected = diffusers_forward(reference, latents, timestep, text)
    assert out.shape == expected.shape == latents.shape
    assert (out - expected).abs().max().item() <= 1e-5


def test_test_key_map_agrees_with_diffusers_converter(reference):
    original = {diffusers_to_original_key(k): v for k, v in reference.state_dict().items()}
    converted = convert_wan_transformer_to_diffusers(dict(original))
    assert sorted(converted) == sorted(reference.state_dict())


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s[:4])))
def test_original_layout_matches_diffusers(reference, original_dir, shape):
    model = load_wan_transformer(original_dir, dtype=torch.float32)
    latents, timestep, text = make_inputs(*shape)
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl())
    assert (out - diffusers_forward(reference, latents, timestep, text)).abs().max().item() <= 1e-5


def test_sharded_checkpoint_loads(reference, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_wan_transformer(tmp_path, dtype=torch.float32)
    latents, timestep, text = make_inputs(*SHAPES[2])
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl())
    assert (out - diffusers_forward(reference, latents, timestep, text)).abs().max().item() <= 1e-5


def test_flash_reference_provider_equals_sdpa(diffusers_dir):
    model = load_wan_transformer(diffusers_dir, dtype=torch.float32)
    flash = FlashAttentionImpl("reference")
    assert flash.provider == "reference"
    for shape in SHAPES[1:3]:
        latents, timestep, text = make_inputs(*shape)
        with torch.no_grad():
            a = model(latents, timestep, text, attention=flash)
            b = model(latents, timestep, text, attention=SDPAImpl())
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", [SDPAImpl(), FlashAttentionImpl("reference")], ids=lambda i: i.provider)
def test_text_lens_masks_padding_like_unpadded_prompts(reference, diffusers_dir, impl):
    """With text_lens, each row equals diffusers run on that prompt alone, unpadded."""
    model = load_wan_transformer(diffusers_dir, dtype=torch.float32)
    lengths = (5, 11)
    latents, timestep, text = make_inputs(2, 3, 4, 6, lengths)
    with torch.no_grad():
        out = model(latents, timestep, text, attention=impl, text_lens=torch.tensor(lengths))
    for row, length in enumerate(lengths):
        expected = diffusers_forward(
            reference, latents[row : row + 1], timestep[row : row + 1], text[row : row + 1, :length]
        )
        assert (out[row : row + 1] - expected).abs().max().item() <= 1e-5
    # and the masked result differs from Wan's unmasked one, so the test would notice a dropped mask
    with torch.no_grad():
        dense = model(latents, timestep, text, attention=impl)
    assert (dense - out).abs().max().item() > 1e-3


def test_bf16_load_keeps_diffusers_fp32_modules(diffusers_dir):
    reference_bf16 = WanTransformer3DModel.from_pretrained(diffusers_dir, torch_dtype=torch.bfloat16).eval()
    model = load_wan_transformer(diffusers_dir, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in reference_bf16.named_parameters()}
    assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()
    latents, timestep, text = make_inputs(*SHAPES[2])
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl())
    expected = diffusers_forward(reference_bf16, latents.bfloat16(), timestep, text.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max().item() <= 1e-2


def test_config_round_trips_and_presets():
    defaults = {
        name: param.default
        for name, param in inspect.signature(WanTransformer3DModel.__init__).parameters.items()
        if name != "self"
    }
    defaults["patch_size"] = list(defaults["patch_size"])
    assert WanConfig.wan21_t2v_14b().to_diffusers_config() == defaults  # diffusers' defaults are the 14B
    small = WanConfig.wan21_t2v_1_3b()
    assert (small.dim, small.num_layers, small.ffn_dim) == (1536, 30, 8960)
    assert WanConfig.from_diffusers_config(small.to_diffusers_config()) == small
    with pytest.raises(ValidationError, match="image_dim=1280 and added_kv_proj_dim=None"):
        WanConfig.from_diffusers_config({**small.to_diffusers_config(), "image_dim": 1280})
    with pytest.raises(ValidationError, match="unknown Wan config field 'bogus'"):
        WanConfig.from_diffusers_config({"bogus": 1})


def test_missing_dir_is_a_load_error(tmp_path):
    with pytest.raises(LoadError, match="not found"):
        load_wan_transformer(tmp_path / "nope")


def test_wrong_shaped_tensor_names_file_and_tensor(diffusers_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(diffusers_dir, broken)
    weights = broken / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["blocks.1.attn2.to_k.weight"] = torch.zeros(32, 31)
    save_file(state, str(weights))
    with pytest.raises(LoadError) as info:
        load_wan_transformer(broken, dtype=torch.float32)
    message = str(info.value)
    assert str(weights) in message and "blocks.1.attn2.to_k.weight" in message and "\n" not in message


def test_half_an_image_path_is_a_load_error(diffusers_dir, tmp_path):
    broken = tmp_path / "i2v"
    shutil.copytree(diffusers_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(LoadError, match=r"config\.json.*image_dim=1280 and added_kv_proj_dim=None"):
        load_wan_transformer(broken, dtype=torch.float32)


def test_bad_latent_shapes_raise(diffusers_dir):
    model = load_wan_transformer(diffusers_dir, dtype=torch.float32)
    latents, timestep, text = make_inputs(1, 1, 8, 12, (4,))
    with pytest.raises(ValidationError, match="patches"):
        model(latents[..., :7, :], timestep, text, attention=SDPAImpl())
    with pytest.raises(ValidationError, match="timestep"):
        model(latents, timestep.repeat(2), text, attention=SDPAImpl())
