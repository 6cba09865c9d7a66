"""prepare -> run -> record (pipelines.plan, pipelines.run, pipelines.record) on the embedded tiny default model."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.placement.policy import MemoryPlan
from pipelines.fp8_choice import Fp8Context, choose_fp8
from pipelines.plan import GenerationPlan, prepare
from pipelines.record import RECORDED_FIELDS
from pipelines.request import GenerationRequest
from pipelines.wan_t2i import WanT2IPipeline
from pipelines.wan_t2v import WanT2VPipeline

CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


def test_prepare_fills_the_model_defaults_and_decides_before_any_work(pipe):
    placement = pipe.placement
    request = GenerationRequest.from_call(prompt="a red ball", offload="layer", block_chunk=9)
    plan = prepare(request, pipe)
    assert isinstance(plan, GenerationPlan) and pipe.placement is placement  # nothing moved yet
    defaults = pipe.defaults
    resolved = plan.request
    assert (resolved.height, resolved.width, resolved.num_frames) == (
        defaults.height,
        defaults.width,
        defaults.num_frames,
    )
    assert resolved.num_inference_steps == defaults.num_inference_steps and resolved.seed is not None
    assert resolved.max_sequence_length == pipe.transformer.config.text_len
    assert len(plan.steps) == resolved.num_inference_steps and {s.expert for s in plan.steps} == {0}
    assert plan.memory.offload == "layer" and plan.settings.block_chunk == 9
    assert plan.settings.block_stream is None  # the placement's stream joins in run
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.memory = MemoryPlan()
    with pytest.raises(ValidationError, match="two-expert checkpoint"):  # a check that needs the model
        prepare(GenerationRequest.from_call(prompt="x", guidance_scale_2=3.0), pipe)


def test_generate_is_the_call(pipe):
    called = pipe("a red ball", progress=False, **CALL)
    request = GenerationRequest.from_call(prompt="a red ball", **CALL)
    generated = pipe.generate(request, progress=False)
    assert generated.frames_sha256 == called.frames_sha256 and generated.args == called.args
    recorded = prepare(request, pipe).request.record()  # args: the request's own record, defaults filled
    assert {name: called.args[name] for name in RECORDED_FIELDS} == {
        name: recorded[name] for name in RECORDED_FIELDS
    }


def test_offload_and_budget_off_cuda_say_they_do_not_apply(pipe):
    plain = pipe("a red ball", progress=False, **CALL).args["memory_plan"]
    assert "note" not in plain
    for extra in (dict(offload="layer"), dict(offload="model"), dict(gpu_memory_gb=4.0)):
        plan = pipe("a red ball", progress=False, **CALL, **extra).args["memory_plan"]
        assert plan["note"].startswith("device cpu: ") and "save no device memory" in plan["note"], extra
    assert "(device cpu:" in MemoryPlan(offload="layer", note="device cpu: x").describe()


def _lossy(**flags):
    return SimpleNamespace(**{"fp8_linear": None, "fp8_attention": None, "from_preset": frozenset(), **flags})


def test_fp8_one_decision_skips_a_preset_part_and_raises_for_an_explicit_one(pipe):
    attention = pipe.attention_for("sdpa")
    resident, layer = MemoryPlan(), MemoryPlan(offload="layer")
    kinds = frozenset({"self_qkv"})
    # CPU: not native, so a preset's parts are skipped with the reason ...
    preset = _lossy(fp8_linear=True, fp8_attention=True)
    preset.from_preset = frozenset({"fp8_linear", "fp8_attention"})
    chosen = choose_fp8(preset, Fp8Context.of(pipe, resident, attention), kinds)
    assert chosen.linear_layers == frozenset() and not chosen.attention
    assert (
        set(chosen.skipped) == {"fp8_linear", "fp8_attention"}
        and "device cpu" in chosen.skipped["fp8_linear"]
    )
    # ... an explicit request runs (emulated) ...
    explicit = choose_fp8(_lossy(fp8_linear=True), Fp8Context.of(pipe, resident, attention), kinds)
    assert explicit.linear_layers == kinds and explicit.skipped == {}
    # ... and raises where it cannot run at all.
    with pytest.raises(ValidationError, match="fp8_linear with offload 'layer' is not supported"):
        choose_fp8(_lossy(fp8_linear=True), Fp8Context.of(pipe, layer, attention), kinds)
    several = dataclasses.replace(Fp8Context.of(pipe, resident, attention), single_rank=False)
    with pytest.raises(ValidationError, match="several ranks"):
        choose_fp8(_lossy(fp8_attention=True), several, kinds)


def test_text_to_image_still_runs(default_model_dir):
    t2i = WanT2IPipeline.from_pretrained(default_model_dir)
    result = t2i("a red ball", height=32, width=48, num_inference_steps=2, seed=5, progress=False)
    assert result.frames.shape == (1, 32, 48, 3) and result.args["num_frames"] == 1
    with pytest.raises(ValidationError, match="WanT2IPipeline makes one frame"):
        t2i("a red ball", num_frames=5, progress=False)


def test_noise_sources_are_checked_before_any_work(pipe):
    with pytest.raises(ValidationError, match="either seed or generator"):
        pipe("a red ball", generator=torch.Generator(), progress=False, **CALL)
    with pytest.raises(ValidationError, match="CPU torch.Generator"):
        pipe("a red ball", generator="gen", progress=False, **{**CALL, "seed": None})


def test_the_pipeline_module_stays_small_and_its_functions_short():
    """wan_t2v.py holds the pipeline object only (<= 400 lines); no function of pipelines/ runs over 80 lines."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "pipelines"
    assert len((root / "wan_t2v.py").read_text().splitlines()) <= 400
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []
