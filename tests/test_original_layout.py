"""The original Wan2.2 A14B repository layout (high_noise_model/, low_noise_model/, Wan2.1_VAE.pth, the T5
.pth, google/umt5-xxl/) loads as a whole pipeline; tiny layout built here, names written by the test's
own rules (the original module names), weights compared with the sources they were saved from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from wan_cases import diffusers_to_original_key, t5_original_key, vae_original_key

from mmgen.errors import LoadError
from mmgen.loading.diffusers_dir import load_wan_components
from mmgen.loading.umt5 import load_umt5_encoder
from mmgen.models.wan import WanConfig, WanDiT

Z = 16  # the original layout's VAE is Wan2.1's (z_dim 16)
VAE = dict(base_dim=16, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True])
VAE_SCALES = dict(scale_factor_spatial=4, scale_factor_temporal=4)


def _dit(seed: int, text_dim: int) -> WanDiT:
    torch.manual_seed(seed)
    config = WanConfig(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=Z,
        out_channels=Z,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
    )
    return WanDiT(config).eval()


def _original_config(dit: WanDiT, model_type: str) -> dict:
    c = dit.config
    return {
        "_class_name": "WanModel",
        "dim": c.dim,
        "num_heads": c.num_attention_heads,
        "in_dim": c.in_channels,
        "out_dim": c.out_channels,
        "ffn_dim": c.ffn_dim,
        "freq_dim": c.freq_dim,
        "num_layers": c.num_layers,
        "eps": c.eps,
        "text_dim": c.text_dim,
        "text_len": 512,
        "model_type": model_type,
    }


@pytest.fixture(scope="module")
def layout(default_model_dir, tmp_path_factory):
    """(directory, sources): a tiny original-layout A14B checkpoint and the modules it was saved from."""
    from diffusers import AutoencoderKLWan

    directory = tmp_path_factory.mktemp("Wan2.2-T2V-A14B")
    text_encoder = load_umt5_encoder(default_model_dir / "text_encoder")
    experts = [_dit(seed, text_encoder.config.d_model) for seed in (1, 2)]
    for name, dit in zip(("high_noise_model", "low_noise_model"), experts, strict=True):
        (directory / name).mkdir()
        (directory / name / "config.json").write_text(json.dumps(_original_config(dit, "t2v")))
        tensors = {diffusers_to_original_key(k): v.contiguous() for k, v in dit.state_dict().items()}
        save_file(tensors, str(directory / name / "diffusion_pytorch_model.safetensors"))
    torch.manual_seed(3)
    vae = AutoencoderKLWan(**VAE, **VAE_SCALES).eval()
    torch.save(
        {vae_original_key(k, VAE["num_res_blocks"]): v for k, v in vae.state_dict().items()},
        directory / "Wan2.1_VAE.pth",
    )
    t5 = {t5_original_key(k): v for k, v in text_encoder.state_dict().items()}
    torch.save(t5, directory / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(default_model_dir / "tokenizer", directory / "google" / "umt5-xxl")
    (directory / "configuration.json").write_text(
        json.dumps({"framework": "Pytorch", "task": "text-to-video"})
    )
    return directory, {"experts": experts, "vae": vae, "text_encoder": text_encoder}


def test_loads_every_component_with_the_source_weights(layout):
    directory, sources = layout
    c = load_wan_components(directory)
    assert c.boundary_ratio == 0.875 and c.scheduler.config.flow_shift == 12.0
    assert (c.defaults.height, c.defaults.width, c.defaults.num_frames) == (720, 1280, 81)
    for loaded, source in zip((c.transformer, c.transformer_2), sources["experts"], strict=True):
        for name, tensor in source.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name].float(), tensor.float(), rtol=0, atol=0)
    ids = torch.tensor([[5, 9, 3, 1]])
    with torch.no_grad():
        torch.testing.assert_close(c.text_encoder(ids), sources["text_encoder"](ids))
        latents = torch.randn(1, Z, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(
            c.vae.decode(latents, return_dict=False)[0], sources["vae"].decode(latents, return_dict=False)[0]
        )
    assert c.vae.config.temperal_downsample == [True, True] and c.vae.config.dim_mult == [1, 2, 2]


def test_generates_as_a_whole_pipeline(layout):
    from pipelines.wan_t2v import WanT2VPipeline

    directory, _ = layout
    pipe = WanT2VPipeline.from_pretrained(directory)
    result = pipe("a red circle", height=32, width=32, num_frames=5, num_inference_steps=2, seed=0)
    assert result.frames.shape == (5, 32, 32, 3)
    assert "A14B" in result.args["defaults"] and result.args["variant"] == "t2v"


def test_offload_reads_both_experts_into_the_pinned_store(layout):
    from mmgen.placement.tensors import PinnedStore
    from pipelines.wan_t2v import WanT2VPipeline

    directory, _ = layout
    call = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=0, progress=False)
    pipe = WanT2VPipeline.from_pretrained(directory, offload="layer")
    store = pipe._host
    assert isinstance(store, PinnedStore) and store.made > 0
    offloaded = pipe("a red circle", **call)
    groups = list(pipe.placement.stream._groups.values())
    assert len(groups) == 2 * len(pipe.transformer.blocks)  # both experts' blocks streamed
    assert all(g.copied == 0 and g.adopted > 0 for g in groups)  # their host copies are the loaded buffers
    resident = WanT2VPipeline.from_pretrained(directory)("a red circle", **call)
    assert offloaded.latents_sha256 == resident.latents_sha256


def _broken(layout, tmp_path: Path) -> Path:
    directory = tmp_path / "broken"
    shutil.copytree(layout[0], directory)
    return directory


def _edit_pth(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_missing_unknown_and_misshapen_tensors_are_named(layout, tmp_path):
    directory = _broken(layout, tmp_path)
    (directory / "Wan2.1_VAE.pth").unlink()
    with pytest.raises(LoadError, match=r"Wan2\.1_VAE\.pth: file not found"):
        load_wan_components(directory)

    directory = _broken(layout, tmp_path / "a")
    _edit_pth(directory / "Wan2.1_VAE.pth", lambda s: s.update({"decoder.extra.weight": torch.zeros(1)}))
    with pytest.raises(LoadError, match=r"Wan2\.1_VAE\.pth: unknown tensor 'decoder\.extra\.weight'"):
        load_wan_components(directory)

    directory = _broken(layout, tmp_path / "b")
    _edit_pth(directory / "Wan2.1_VAE.pth", lambda s: s.pop("decoder.head.2.bias"))
    with pytest.raises(LoadError, match=r"lacks tensors the model needs: decoder\.conv_out\.bias"):
        load_wan_components(directory)

    directory = _broken(layout, tmp_path / "c")
    t5 = directory / "models_t5_umt5-xxl-enc-bf16.pth"
    _edit_pth(t5, lambda s: s.update({"blocks.0.ffn.fc2.weight": s["blocks.0.ffn.fc2.weight"][:, :-1]}))
    with pytest.raises(LoadError, match=r"tensor 'blocks\.0\.ffn\.fc2\.weight' has shape"):
        load_wan_components(directory)


def test_expert_configs_must_agree(layout, tmp_path):
    directory = _broken(layout, tmp_path)
    path = directory / "low_noise_model" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "i2v"}))
    with pytest.raises(LoadError, match="high_noise_model is 't2v' but low_noise_model is 'i2v'"):
        load_wan_components(directory)
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "ti2v"}))
    with pytest.raises(LoadError, match="model_type 'ti2v' is not a Wan2.2 A14B expert"):
        load_wan_components(directory)


def test_unreadable_pth_is_a_load_error(layout, tmp_path):
    directory = _broken(layout, tmp_path)
    (directory / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(LoadError, match="not a readable PyTorch state dict"):
        load_wan_components(directory)
