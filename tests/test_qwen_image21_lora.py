"""Qwen-Image-2.1 LoRAs: the layouts diffusers' QwenImage21Pipeline reads (its LoRA loader is Qwen-Image's
QwenImageLoraLoaderMixin; diffusers 0.42.1 has no loader of 2.1's own), against diffusers and PEFT.

mmgen's 2.1 transformer has diffusers' parameter names, so mmgen's Qwen-Image reader
(mmgen.lora.qwen_image.parse_qwen_image_lora) names its modules as they are:
- a PEFT adapter (LoraConfig r=4, lora_alpha=8 over every Linear of the block and the embeddings) added
  to diffusers' QwenImage21Transformer2DModel with random pairs, saved by diffusers' save_lora_weights
  (the LoraConfig in the metadata: scale alpha / r): mmgen's output with it, fused and unfused, equals
  diffusers' output through the PEFT layers (fp32, 1e-5 as the model parity tests);
- the same pairs as ComfyUI (diffusion_model.*, .alpha) and bare (lora_A / lora_B, .alpha) files: mmgen
  fused at strength 0.8 gives diffusers' load_lora_weights + fuse_lora(lora_scale=0.8) weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from qwen_image21_cases import TINY_TRANSFORMER, diffusers_inputs, run_diffusers, run_mmgen, tiny_transformer
from torch import nn

from mmgen.attention.impls import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.lora import LoRARequest, LoRASlot
from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
from pipelines.qwen_image21_family import read_qwen_image21_lora

RANK, ALPHA, STRENGTH = 4, 8.0, 0.8
EDIT = ([11], [(2, 2)], [(1, 2, 4), (1, 4, 4)])  # one prompt with a condition image's slots


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    return tiny_transformer(seed=2)


def _linears(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


@pytest.fixture(scope="module")
def peft_file(reference, tmp_path_factory):
    """(diffusers' transformer with a random PEFT adapter on every Linear, the file save_lora_weights wrote)."""
    from diffusers import QwenImage21Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    adapted = copy.deepcopy(reference)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=_linears(reference), init_lora_weights=False)
    adapted.add_adapter(config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    directory = tmp_path_factory.mktemp("q21lora")
    QwenImage21Pipeline.save_lora_weights(
        str(directory),
        transformer_lora_layers=get_peft_model_state_dict(adapted),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    return adapted.eval(), directory / "pytorch_lora_weights.safetensors"


def _ours(reference) -> QwenImage21Transformer:
    model = QwenImage21Transformer(QwenImage21Config(**TINY_TRANSFORMER)).eval()
    model.load_state_dict(reference.state_dict())
    return model


def _prediction(model, inputs, grids) -> torch.Tensor:
    return run_mmgen(model, inputs, grids, SDPAImpl())


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_peft_adapter_output_matches_diffusers(reference, peft_file, mode):
    adapted, path = peft_file
    text_lens, slot_runs, grids = EDIT
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=4)
    expected = run_diffusers(adapted, inputs)
    ours = _ours(reference)
    base = _prediction(ours, inputs, grids)
    slot = LoRASlot(reader=read_qwen_image21_lora)
    report = slot.use((ours,), [LoRARequest(path=path)], mode=mode)
    file = report.files[0]
    assert file.format == "diffusers" and file.scales == (ALPHA / RANK,)
    assert file.per_expert[0].weights == len(_linears(reference)) and not file.per_expert[0].not_matched
    got = _prediction(ours, inputs, grids)
    assert (got - expected).abs().max().item() <= 1e-5
    assert (base - expected).abs().max().item() > 1e-2  # the adapter changes the output
    slot.clear()
    assert torch.equal(_prediction(ours, inputs, grids), base)  # base weights back bit for bit


def _layouts(pairs: dict) -> dict[str, dict[str, torch.Tensor]]:
    alpha = torch.tensor(ALPHA)
    comfy, bare = {}, {}
    for module, (down, up) in pairs.items():
        for state, prefix, (a, b) in (
            (comfy, f"diffusion_model.{module}", ("lora_down", "lora_up")),
            (bare, module, ("lora_A", "lora_B")),
        ):
            state.update({f"{prefix}.{a}.weight": down, f"{prefix}.{b}.weight": up, f"{prefix}.alpha": alpha})
    return {"comfy": comfy, "bare": bare}


@pytest.mark.parametrize("layout", ["comfy", "bare"])
def test_fused_files_match_diffusers_fuse(reference, layout, tmp_path):
    from diffusers import QwenImage21Pipeline
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(5)
    pairs = {}
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear):
            down = torch.randn(RANK, module.in_features, generator=generator) * 0.1
            pairs[name] = (down, torch.randn(module.out_features, RANK, generator=generator) * 0.1)
    path = tmp_path / f"{layout}.safetensors"
    save_file({k: v.clone().contiguous() for k, v in _layouts(pairs)[layout].items()}, str(path))
    from qwen_image21_pipeline_cases import tiny_processor

    processor = tiny_processor(tmp_path / "processor")  # the pipeline reads its chat template at init
    pipe = QwenImage21Pipeline(
        scheduler=None, vae=None, text_encoder=None, processor=processor, transformer=copy.deepcopy(reference)
    )
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora(lora_scale=STRENGTH)
    pipe.unload_lora_weights()
    expected = pipe.transformer.state_dict()
    ours = _ours(reference)
    LoRASlot(reader=read_qwen_image21_lora).use((ours,), [LoRARequest(path=path, strength=STRENGTH)])
    got = ours.state_dict()
    assert sorted(got) == sorted(expected)
    # fp32 W + s * (up @ down) with rank 4: both sides round the same sum, differently ordered
    assert max((got[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6


def test_keys_of_another_model_fail_closed(reference, tmp_path):
    """Qwen-Image 1.0's module names (img_mlp.net.0.proj, attn.add_q_proj) are not 2.1's: refused."""
    from safetensors.torch import save_file

    state = {
        "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.lora_down.weight": torch.zeros(RANK, 64),
        "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.lora_up.weight": torch.zeros(192, RANK),
        "diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(RANK, 64),
        "diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight": torch.zeros(64, RANK),
    }
    path = tmp_path / "v1.safetensors"
    save_file(state, str(path))
    ours = _ours(reference)
    with pytest.raises(ValidationError, match="2 of 4 keys match no weight"):
        LoRASlot(reader=read_qwen_image21_lora).use((ours,), [LoRARequest(path=path)])
