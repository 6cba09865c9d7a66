"""Qwen-Image-2.1 pipeline placement and parallel layouts on the tiny random directory (CPU, fp32): offload
'model' and 'layer' against resident; Ulysses / CFG parallel pipelines on forked gloo worlds against one
process (text-to-image and an edit, guided, the prefix KV cache on).

On the CPU the offload placements move nothing across devices (host and device are one), so these
check the placement's wiring (which component is loaded when, the block stream in each call, the VAE
around the condition image's encode) and that the values are the resident run's bits; the pinned
host buffers and the side-stream copies run on CUDA only (tests/test_placement_streams.py).
"""

from __future__ import annotations

import parallel_workers
import pytest
import qwen_image21_parallel_workers as workers
import torch
from qwen_image_cases import check_offload_placement

from mmgen.errors import ValidationError
from mmgen.parallel.layout import ParallelConfig

pytest.importorskip("diffusers")
COMMON = {"seed": 12, "height": 64, "width": 96, "num_inference_steps": 2, "progress": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qwen_image21_pipeline_cases import tiny_parts, write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21place")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


@pytest.fixture(scope="module")
def resident(model_dir):
    from mmgen.families import load_pipeline

    return load_pipeline(model_dir, task="t2i", device="cpu", dtype="float32")


@pytest.mark.parametrize("offload", ["model", "layer"])
def test_offload_gives_the_resident_image(model_dir, resident, offload, tmp_path):
    from mmgen.families import load_pipeline

    pipe = load_pipeline(model_dir, task="t2i", device="cpu", dtype="float32", offload=offload)
    result = pipe("a red cat", "dark", guidance_scale=3.0, **COMMON)
    assert result.frames_sha256 == resident("a red cat", "dark", guidance_scale=3.0, **COMMON).frames_sha256
    check_offload_placement(pipe, result, offload)
    # a LoRA (fused into the weights where they live) gives the resident pipeline's LoRA image
    lora = _write_lora(resident.transformer, tmp_path / "style.safetensors")
    styled = pipe("a red cat", lora=f"{lora}:0.8", **COMMON)
    assert styled.frames_sha256 == resident("a red cat", lora=f"{lora}:0.8", **COMMON).frames_sha256
    assert styled.frames_sha256 != pipe("a red cat", **COMMON).frames_sha256  # base weights back
    assert styled.args["loras"]["files"][0]["format"] == "qwen-image"
    with pytest.raises(ValidationError, match="only 'fused' LoRAs"):
        pipe("sky", lora=str(lora), lora_mode="unfused", progress=False)


def test_unfused_lora_equals_fused_on_the_resident_pipeline(resident, tmp_path):
    lora = _write_lora(resident.transformer, tmp_path / "style.safetensors")
    fused = resident("a red cat", lora=f"{lora}:0.8", **COMMON)
    unfused = resident("a red cat", lora=f"{lora}:0.8", lora_mode="unfused", **COMMON)
    # the same pairs beside the weight instead of merged into it: fp32 rounding of one extra GEMM
    torch.testing.assert_close(unfused.latents, fused.latents, atol=1e-5, rtol=0)
    assert (fused.latents - resident("a red cat", **COMMON).latents).abs().max() > 1e-3


def _write_lora(transformer, path):
    """A ComfyUI-layout LoRA (rank 2, alpha 4) on every Linear of the transformer's blocks."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(9)
    state = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
            prefix = f"diffusion_model.{name}"
            state[f"{prefix}.lora_down.weight"] = (
                torch.randn(2, module.in_features, generator=generator) * 0.3
            )
            state[f"{prefix}.lora_up.weight"] = torch.randn(module.out_features, 2, generator=generator) * 0.3
            state[f"{prefix}.alpha"] = torch.tensor(4.0)
    save_file(state, str(path))
    return path


def test_offload_edit_encodes_the_condition_with_the_vae_loaded(model_dir):
    """An edit (condition images at 64 x 64 pixels, as the tiny processor's vision slots expect)."""
    import numpy as np

    from mmgen.loading.qwen_image21_dir import load_qwen_image21_components
    from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

    def pipeline(offload):
        parts = load_qwen_image21_components(model_dir, dtype=torch.float32)
        return QwenImage21FamilyPipeline(parts, condition_resolution=64, offload=offload)

    pixels = (np.random.RandomState(1).rand(64, 96, 3) * 255).astype(np.uint8)
    pipe, common = pipeline("model"), {**COMMON, "height": None, "width": None}
    result = pipe("make it blue", image=pixels, **common)
    assert result.frames_sha256 == pipeline("none")("make it blue", image=pixels, **common).frames_sha256
    loads = [name for action, name in pipe.placement.log if action == "load"]
    assert loads == ["text_encoder", "vae", "expert0", "vae"]  # the VAE in for the condition, then the decode


@pytest.mark.parametrize(
    "config", [ParallelConfig(sp=2), ParallelConfig(cfg=True), ParallelConfig(sp=2, cfg=True)], ids=str
)
@pytest.mark.parametrize("edit", [False, True], ids=["t2i", "edit"])
def test_pipeline_on_a_gloo_world_matches_one_process(model_dir, config, edit):
    single = workers.generate_latents(None, model_dir, edit)
    latents = parallel_workers.run_forked(workers.generate_latents, config, model_dir, edit)
    # Two guided steps (prefill, cached step): each rank's rounding differs from one process's by GEMM
    # shape at most (a shard of the rows, one CFG branch of batch 1 instead of both packed), a few fp32
    # ulps per op; the family tests compare such shapes within 1e-5 (latents O(1)).
    torch.testing.assert_close(latents, single, atol=1e-5, rtol=0)
