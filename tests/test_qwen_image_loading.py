"""Loading a diffusers-format Qwen-Image transformer directory (written by diffusers' save_pretrained)."""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.attention.impls import SDPAImpl
from mmgen.errors import LoadError
from mmgen.loading.qwen_image import load_qwen_image_transformer, read_qwen_image_config
from mmgen.models.qwen_image import QwenImageConfig

TINY = {
    "patch_size": 2,
    "in_channels": 8,
    "out_channels": 2,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 12,
    "axes_dims_rope": (4, 6, 6),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, diffusers model): the tiny transformer saved in small shards (an index + files)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(**TINY).eval()
    directory = tmp_path_factory.mktemp("qwen") / "transformer"
    model.save_pretrained(directory, max_shard_size="40KB")
    return directory, model


def test_loads_sharded_directory_and_matches(saved):
    directory, reference = saved
    assert len(list(directory.glob("*.safetensors"))) > 1
    assert read_qwen_image_config(directory) == QwenImageConfig(**TINY)
    model = load_qwen_image_transformer(directory, dtype=torch.float32)
    state = reference.state_dict()
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert not any(p.requires_grad for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 12, TINY["in_channels"], generator=generator)
    text = torch.randn(2, 5, TINY["joint_attention_dim"], generator=generator)
    timestep = torch.tensor([0.3, 0.3])
    with torch.no_grad():
        expected = reference(
            hidden_states=latents,
            encoder_hidden_states=text,
            timestep=timestep,
            img_shapes=[[(1, 3, 4)]] * 2,
            return_dict=False,
        )[0]
        got = model(latents, timestep, text, grids=((1, 3, 4),), attention=SDPAImpl())
    assert (got - expected).abs().max().item() <= 1e-5
    assert load_qwen_image_transformer(directory).dtype == torch.bfloat16


def test_errors_name_the_file(saved, tmp_path):
    directory, _ = saved
    other = tmp_path / "other"
    other.mkdir()
    for path in directory.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_class_name": "WanTransformer3DModel"}))
    with pytest.raises(LoadError, match="not a Qwen-Image transformer config"):
        load_qwen_image_transformer(other)
    (other / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(LoadError, match="lacks tensors"):
        load_qwen_image_transformer(other)
    (other / "config.json").write_text(json.dumps({**config, "num_layers": 1}))
    with pytest.raises(LoadError, match="unknown tensor"):
        load_qwen_image_transformer(other)
    with pytest.raises(LoadError, match="not found"):
        load_qwen_image_transformer(tmp_path / "missing")
