"""Qwen-Image LoRAs in the layouts diffusers' QwenImageLoraLoaderMixin reads, against diffusers' own fuse.

One set of random low-rank pairs (rank 4, alpha 8) over every Linear of the tiny transformer, written
as diffusers/PEFT (transformer.*, alpha baked in), ComfyUI/lightx2v (diffusion_model.*, .alpha),
bare module names with lora_A/lora_B and .alpha (the Lightning files' kind) and kohya (lora_unet_*
flattened). Each file, fused by mmgen at strength 0.8, gives diffusers' load_lora_weights +
fuse_lora(lora_scale=0.8) weights; removal restores the base bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from qwen_image_cases import TINY_TRANSFORMER, tiny_transformer
from torch import nn

from mmgen.errors import ValidationError
from mmgen.lora import LoRARequest, LoRASlot, read_lora_file
from mmgen.lora.qwen_image import FLAT_LEAVES, flat_module, parse_qwen_image_lora
from mmgen.models.qwen_image import QwenImageConfig, QwenImageTransformer

RANK, ALPHA, STRENGTH = 4, 8.0, 0.8


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    return tiny_transformer()


@pytest.fixture(scope="module")
def pairs(reference):
    """{module: (down [r, in], up [out, r])} for every Linear of the transformer."""
    generator = torch.Generator().manual_seed(5)
    found = {}
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear):
            down = torch.randn(RANK, module.in_features, generator=generator) * 0.1
            found[name] = (down, torch.randn(module.out_features, RANK, generator=generator) * 0.1)
    return found


def _flat(module: str) -> str:
    """The kohya name of a dotted module name (the inverse of flat_module)."""
    return "lora_unet_" + module.replace(".", "_")


def _layouts(pairs):
    alpha = torch.tensor(ALPHA)
    peft, comfy, bare, kohya = {}, {}, {}, {}
    for module, (down, up) in pairs.items():
        peft[f"transformer.{module}.lora_A.weight"] = down
        peft[f"transformer.{module}.lora_B.weight"] = up * (ALPHA / RANK)  # no metadata: scale 1
        for state, prefix, (a, b) in (
            (comfy, f"diffusion_model.{module}", ("lora_down", "lora_up")),
            (bare, module, ("lora_A", "lora_B")),
            (kohya, _flat(module), ("lora_down", "lora_up")),
        ):
            state.update({f"{prefix}.{a}.weight": down, f"{prefix}.{b}.weight": up, f"{prefix}.alpha": alpha})
    return {"peft": peft, "comfy": comfy, "bare": bare, "kohya": kohya}


def _save(state, path):
    from safetensors.torch import save_file

    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(path))
    return path


def _ours(reference) -> QwenImageTransformer:
    model = QwenImageTransformer(QwenImageConfig(**TINY_TRANSFORMER)).eval()
    model.load_state_dict(reference.state_dict())
    return model


def _diffusers_fused(reference, path):
    import diffusers

    pipe = diffusers.QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=copy.deepcopy(reference)
    )
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora(lora_scale=STRENGTH)
    pipe.unload_lora_weights()
    return pipe.transformer.state_dict()


def _reader(path):
    return read_lora_file(path, parse=parse_qwen_image_lora)


def test_flat_names_round_trip(pairs):
    for module in pairs:
        assert flat_module(_flat(module).removeprefix("lora_unet_")) == module
    assert len(FLAT_LEAVES) == 14
    assert flat_module("transformer_blocks_0_attn_to_z") is None


@pytest.mark.parametrize("layout", ["peft", "comfy", "bare", "kohya"])
def test_fused_matches_diffusers(reference, pairs, layout, tmp_path):
    path = _save(_layouts(pairs)[layout], tmp_path / f"{layout}.safetensors")
    expected = _diffusers_fused(reference, path)
    ours = _ours(reference)
    base = {name: value.clone() for name, value in ours.state_dict().items()}
    slot = LoRASlot(reader=_reader)
    report = slot.use((ours,), [LoRARequest(path=path, strength=STRENGTH)])
    assert report.files[0].per_expert[0].weights == len(pairs)
    got = ours.state_dict()
    assert sorted(got) == sorted(expected)
    worst = max((got[name] - expected[name]).abs().max().item() for name in expected)
    assert worst <= 1e-6, worst
    changed = [name for name in got if not torch.equal(got[name], base[name])]
    assert sorted(changed) == sorted(f"{module}.weight" for module in pairs)
    slot.clear()
    assert all(torch.equal(value, base[name]) for name, value in ours.state_dict().items())


def test_unfused_equals_fused_output(reference, pairs, tmp_path):
    path = _save(_layouts(pairs)["comfy"], tmp_path / "comfy.safetensors")
    from mmgen.attention.impls import SDPAImpl

    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 12, TINY_TRANSFORMER["in_channels"], generator=generator)
    text = torch.randn(2, 5, TINY_TRANSFORMER["joint_attention_dim"], generator=generator)
    timestep = torch.tensor([0.5, 0.5])
    outputs = {}
    for mode in ("fused", "unfused"):
        ours = _ours(reference)
        LoRASlot(reader=_reader).use((ours,), [LoRARequest(path=path, strength=STRENGTH)], mode=mode)
        with torch.no_grad():
            outputs[mode] = ours(
                latents, timestep, text, grids=((1, 3, 4),), attention=SDPAImpl(), text_lens=[5, 3]
            )
    assert (outputs["fused"] - outputs["unfused"]).abs().max().item() <= 1e-5


def test_unmatched_keys_fail_closed(reference, pairs, tmp_path):
    state = _layouts(pairs)["comfy"]
    state["diffusion_model.transformer_blocks.9.attn.to_q.lora_down.weight"] = torch.zeros(RANK, 48)
    state["diffusion_model.transformer_blocks.9.attn.to_q.lora_up.weight"] = torch.zeros(48, RANK)
    state["diffusion_model.something_else.weight"] = torch.zeros(2)
    path = _save(state, tmp_path / "extra.safetensors")
    ours = _ours(reference)
    base = {name: value.clone() for name, value in ours.state_dict().items()}
    with pytest.raises(ValidationError, match="3 of .* keys match no weight"):
        LoRASlot(reader=_reader).use((ours,), [LoRARequest(path=path)])
    assert all(torch.equal(value, base[name]) for name, value in ours.state_dict().items())
    report = LoRASlot(reader=_reader).use((ours,), [LoRARequest(path=path)], allow_unmatched=True)
    assert len(report.files[0].per_expert[0].not_matched) == 3


def test_parse_errors():
    with pytest.raises(ValidationError, match="no matching half"):
        parse_qwen_image_lora({"transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(2, 4)})
    both = {
        "transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(2, 4),
        "transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4),
    }
    with pytest.raises(ValidationError, match="both lora_down/lora_up and lora_A/lora_B"):
        parse_qwen_image_lora(both)
