"""mmgen's CLIP vision tower and CLIP preprocessing vs transformers' CLIPVisionModel / CLIPImageProcessor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from mmgen.errors import LoadError
from mmgen.loading.clip_vision import load_clip_vision, load_image_preprocess
from mmgen.models.clip_vision import ClipImagePreprocess

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


@pytest.fixture(scope="module", params=["gelu", "quick_gelu"])
def reference(request) -> CLIPVisionModel:
    torch.manual_seed(0)
    model = CLIPVisionModel(CLIPVisionConfig(**TINY, hidden_act=request.param)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def test_penultimate_hidden_states_match_transformers(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    model = load_clip_vision(tmp_path)
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        out = model(pixels)
    assert out.shape == (2, 5, 32)
    assert (out - expected).abs().max().item() <= 1e-5


def test_old_prefixed_checkpoint_loads(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    state = {f"vision_model.{k}": v.contiguous() for k, v in reference.state_dict().items()}
    state["vision_model.embeddings.position_ids"] = torch.arange(5)[None]
    for old in tmp_path.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_clip_vision(tmp_path)
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        assert (model(pixels) - expected).abs().max().item() <= 1e-5


def test_wrong_architecture_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5Model"]}))
    with pytest.raises(LoadError, match="architectures"):
        load_clip_vision(tmp_path)


@pytest.mark.parametrize("size", [(300, 200), (200, 301), (224, 224), (641, 97)])
def test_preprocessing_matches_clip_image_processor(size, tmp_path):
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    processor = CLIPImageProcessor(crop_size=224, size={"shortest_edge": 224})
    expected = processor(images=image, return_tensors="pt")["pixel_values"]
    processor.save_pretrained(tmp_path)
    ours = load_image_preprocess(tmp_path)
    assert ours == ClipImagePreprocess()
    out = ours(image)
    assert out.shape == expected.shape == (1, 3, 224, 224)
    assert (out - expected).abs().max().item() <= 1e-5
