"""mmgen.placement: offload none | model | layer, exact against the resident path, the expert
prefetch order, the budget planner and its too-small error, the exact per-frame decode.

Everything runs on the CPU with a CPU "device": offloaded weights compute on device buffers that are
distinct from their host copies (the same binding and streaming code as on a GPU, minus streams).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from wan_cases import TINY

from mmgen.attention import select_attention
from mmgen.errors import ValidationError
from mmgen.layers.mlp import GeluTanhFeedForward
from mmgen.layers.rotary import rope_3d_tables
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanDiT
from mmgen.models.wan_blocks import WanCall
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.peaks import StagePeaks
from mmgen.placement.policy import (
    CHUNK_ALIGN,
    GIB,
    MemoryPlan,
    ModelSizes,
    Workload,
    plan_memory,
    stage_peaks,
)
from mmgen.placement.stream import BlockStream
from mmgen.placement.tensors import TensorGroup
from pipelines.denoise import plan_steps
from pipelines.wan_t2v import WanT2VPipeline

CPU = torch.device("cpu")
ATTENTION = select_attention("sdpa", device=CPU, dtype=torch.float32, head_dim=16)


def tiny_expert(seed: int) -> WanDiT:
    torch.manual_seed(seed)
    model = WanDiT(TINY).eval().requires_grad_(False)
    for p in model.parameters():  # random, not the init's zeros/ones, so every weight matters
        p.normal_(0, 0.2)
    return model


def tiny_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(2, 4, 2, 4, 4, generator=g),
        torch.tensor([900.0, 900.0]),
        torch.randn(2, 16, 32, generator=g),
    )


def forward(model: WanDiT, settings: ExecutionSettings | None = None) -> torch.Tensor:
    x, t, text = tiny_inputs()
    return model(x, t, text, attention=ATTENTION, settings=settings)


def streamed_by(placement) -> ExecutionSettings:
    """The settings a pipeline passes under `placement`: its block stream (layer offload) or none."""
    return ExecutionSettings(block_stream=getattr(placement, "stream", None))


def side_modules() -> dict[str, torch.nn.Module]:
    return {"text_encoder": torch.nn.Linear(4, 4), "vae": torch.nn.Linear(4, 4)}


@pytest.mark.parametrize("fused", [False, True])
def test_streamed_blocks_equal_resident_blocks_and_return_to_host(fused):
    resident = tiny_expert(0)
    streamed = copy.deepcopy(resident)
    if fused:
        resident.fuse_projections()
        streamed.fuse_projections()
    expected = forward(resident)
    placement = OffloadPlacement("layer", experts=[streamed], device=CPU, **side_modules())
    log: list = []
    placement.stream.log = log
    seen: list[bool] = []
    for block in streamed.blocks:  # during its own run a block computes on slot buffers, not its host copy
        block.register_forward_pre_hook(
            lambda module, args: seen.append(placement.stream._groups[id(module)].is_bound_to_host())
        )
    out = forward(streamed, streamed_by(placement))
    # Slots hold byte copies of each storage (same shapes, strides, offsets): the same GEMMs, same bits.
    assert torch.equal(out, expected)
    assert seen == [False, False, False]
    # Block i + 1 is copied before block i runs (one ahead); nothing is copied twice.
    assert log == [("copy", 0), ("copy", 1), ("run", 0), ("copy", 2), ("run", 1), ("run", 2)]
    assert all(g.is_bound_to_host() for g in placement.stream._groups.values())
    assert placement.stream.device_bytes == 2 * placement.stream.block_bytes
    if fused:  # the projections stay views of their stacked matrix on the host copy
        attn = streamed.blocks[0].attn1
        assert attn.to_q.weight.data_ptr() == attn.fused_weight.data_ptr()


def test_block_stream_refuses_blocks_of_another_layout():
    stream = BlockStream(CPU, pin=False)
    stream.add([torch.nn.Linear(4, 4)])
    with pytest.raises(ValidationError, match="same parameter shapes"):
        stream.add([torch.nn.Linear(4, 5)])
    with pytest.raises(ValidationError, match="ahead = 0"):
        BlockStream(CPU, ahead=0, pin=False)


def test_tensor_group_parks_without_copying_back():
    layer = torch.nn.Linear(3, 2)
    before = layer.weight.detach().clone()
    group = TensorGroup(layer, pin=False)
    buffers = group.allocate(CPU)
    group.copy_to(buffers, non_blocking=False)
    group.bind(group.views(buffers))
    assert not group.is_bound_to_host() and torch.equal(layer.weight, before)
    group.bind_host()
    assert group.is_bound_to_host() and torch.equal(layer.weight, before)
    assert group.nbytes == (6 + 2) * 4


def _run_experts(experts, placement, expert_plan) -> list[torch.Tensor]:
    timesteps = torch.tensor(
        [999.0 - 100.0 * i if e == 0 else 400.0 - 50.0 * i for i, e in enumerate(expert_plan)]
    )
    steps = plan_steps(timesteps, (5.0, 3.0), boundary_timestep=500.0)
    assert [s.expert for s in steps] == expert_plan
    x, _, text = tiny_inputs()
    outs = []
    for position, step in enumerate(steps):
        upcoming = steps[position + 1] if position + 1 < len(steps) else None
        if placement is not None:
            placement.before_step(step, upcoming)
        t = step.timestep.expand(2)
        outs.append(experts[step.expert](x, t, text, attention=ATTENTION, settings=streamed_by(placement)))
    return outs


@pytest.mark.parametrize("prefetch", [True, False])
def test_model_offload_moves_each_wan22_expert_once_in_order(prefetch):
    resident = [tiny_expert(1), tiny_expert(2)]
    experts = copy.deepcopy(resident)
    expected = _run_experts(resident, None, [0, 0, 0, 1, 1])
    placement = OffloadPlacement(
        "model", experts=experts, device=CPU, prefetch_experts=prefetch, **side_modules()
    )
    states = []

    class Watch:  # records, before each step runs, which experts are on the device
        def before_step(self, step, upcoming):
            placement.before_step(step, upcoming)
            states.append(tuple(not placement._groups[f"expert{i}"].is_bound_to_host() for i in (0, 1)))

    outs = _run_experts(experts, Watch(), [0, 0, 0, 1, 1])
    # moved weights, unchanged shapes: the same GEMMs, so the same bits
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
    if prefetch:
        # expert 1 is copied in during the last step of expert 0 (not every step), expert 0 parked after.
        assert placement.log == [("load", "expert0"), ("prefetch", "expert1"), ("park", "expert0")]
        assert states == [(True, False), (True, False), (True, True), (False, True), (False, True)]
    else:
        assert placement.log == [("load", "expert0"), ("park", "expert0"), ("load", "expert1")]
        assert states == [(True, False)] * 3 + [(False, True)] * 2
    placement.park_all()
    assert placement.resident == ()


def test_layer_offload_serves_both_experts_from_one_set_of_slots():
    resident = [tiny_expert(1), tiny_expert(2)]
    experts = copy.deepcopy(resident)
    expected = _run_experts(resident, None, [0, 0, 1, 1])
    placement = OffloadPlacement("layer", experts=experts, device=CPU, **side_modules())
    outs = _run_experts(experts, placement, [0, 0, 1, 1])
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))  # same shapes: same bits
    assert len(placement.stream._slots) == 2 and len(placement.stream._groups) == 6


def test_using_parks_the_component_after_it_runs():
    modules = side_modules()
    placement = OffloadPlacement("model", experts=[tiny_expert(0)], device=CPU, **modules)
    with placement.using("text_encoder") as encoder:
        assert encoder is modules["text_encoder"]
        assert placement.resident == ("text_encoder",)
    assert placement.resident == ()
    assert placement.log == [("load", "text_encoder"), ("park", "text_encoder")]


def test_ffn_token_chunks_match_the_whole_sequence():
    torch.manual_seed(0)
    ffn = GeluTanhFeedForward(8, 32)
    x = torch.randn(2, 37, 8)
    whole = ffn(x)
    # GEMMs over 10 rows instead of 74: a CPU's BLAS may pick another kernel per shape and round the
    # K <= 32 sums a few ulps apart (values O(1)); 1e-5 leaves room, a wrong chunk is O(1) off.
    torch.testing.assert_close(ffn(x, token_chunk=10), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_block_chunks_match_the_whole_sequence(chunk):
    # 8 tokens per sample: chunk 3 leaves a tail of 2, chunk 1 runs every row alone.
    model = tiny_expert(0)
    whole = forward(model)
    chunked = forward(model, ExecutionSettings(block_chunk=chunk))
    # per-token ops on `chunk` rows at a time: GEMMs of other shapes, a few ulps of O(1) values
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_block_chunks_with_per_token_modulation():
    # Wan2.2 TI2V modulates each token with its own timestep: a table of 3 distinct timesteps'
    # projections [3, 6, dim], and each token's row of it [B, S], sliced per range.
    model = tiny_expert(1)
    block = model.blocks[0]
    dim, tokens = TINY.num_attention_heads * TINY.attention_head_dim, 10
    g = torch.Generator().manual_seed(3)
    x, text = torch.randn(2, tokens, dim, generator=g), torch.randn(2, 5, dim, generator=g)
    projection = torch.randn(3, 6, dim, generator=g)
    token_rows = torch.randint(0, 3, (2, tokens), generator=g, dtype=torch.int32)
    rope = rope_3d_tables((2, 1, 5), TINY.attention_head_dim, device=CPU)
    meta = model.build_attention_metadata(None, text_len=5)
    call = WanCall(
        attention=ATTENTION, metadata=meta, rope=rope, temb=projection[:, 0], x=x, text=text,
        time_projection=projection, grid=(2, 1, 5), token_rows=token_rows,
    )  # fmt: skip
    whole = block(x, call)
    chunked = block(x, replace(call, settings=ExecutionSettings(block_chunk=4)))
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)  # other GEMM shapes: rounding only


def test_sequential_cfg_rows_match_the_batch_of_two():
    # Each sample alone through the DiT (sequential CFG) against both in one batch (batch CFG).
    model = tiny_expert(2)
    x, t, text = tiny_inputs()
    both = model(x, t, text, attention=ATTENTION)
    alone = torch.cat(
        [model(x[i : i + 1], t[i : i + 1], text[i : i + 1], attention=ATTENTION) for i in (0, 1)]
    )
    # Batch 1 vs batch 2: GEMMs of other shapes, which a CPU's BLAS may round a few ulps apart through
    # the 3 blocks (values O(1)); 1e-5 leaves room, a mixed-up row is O(1) off.
    torch.testing.assert_close(alone, both, atol=1e-5, rtol=1e-5)


# Wan2.1-14B-like sizes (bf16), for the planner.
SIZES_14B = ModelSizes(
    expert_bytes=(int(26.6 * GIB),),
    block_bytes=int(26.2 * GIB / 40),
    blocks=40,
    text_encoder_bytes=int(10.6 * GIB),
    vae_bytes=int(0.24 * GIB),
    dim=5120,
    ffn_dim=13824,
    head_dim=128,
    dtype_bytes=2,
    text_dim=4096,
    text_ffn_dim=10240,
    vae_dtype_bytes=2,
    text_block_bytes=int(10.6 * GIB / 25),
    text_blocks=24,
)
WORK_720P = Workload(tokens=75600, guided=True, text_len=512, frames=81, height=720, width=1280)


def test_planner_takes_the_least_offloading_that_fits():
    roomy = plan_memory(SIZES_14B, WORK_720P, 140)
    assert (roomy.offload, roomy.cfg, roomy.decode) == ("none", "batch", "frames")
    at_24 = plan_memory(SIZES_14B, WORK_720P, 24)
    assert at_24.offload == "layer" and not at_24.lossy
    assert dict(at_24.estimate_gib)["denoise"] <= 24
    at_12 = plan_memory(SIZES_14B, WORK_720P, 12)
    assert at_12.offload == "layer"
    # Tighter budgets only ever move further down the candidate list.
    peaks = [max(stage_peaks(SIZES_14B, WORK_720P, p).values()) for p in (roomy, at_24, at_12)]
    assert peaks[0] > peaks[1] >= peaks[2]
    record = at_12.record()
    assert record["budget_gib"] == 12 and set(record["estimate_gib"]) == {"text_encode", "denoise", "decode"}
    assert "offload=layer" in at_12.describe()


def test_planner_counts_fp8_weight_copies_only_when_resident():
    with_fp8 = replace(SIZES_14B, fp8_bytes=int(11.14 * GIB))  # 14B's FP8 copies (test_step_cache)
    assert plan_memory(SIZES_14B, WORK_720P, 60).offload == "none"  # ~52.5 GiB resident fits 60
    assert plan_memory(with_fp8, WORK_720P, 60).offload != "none"  # + 11.1 GiB of copies does not
    offloaded = MemoryPlan(offload="layer", cfg="sequential", decode="bands4")
    assert stage_peaks(with_fp8, WORK_720P, offloaded) == stage_peaks(SIZES_14B, WORK_720P, offloaded)


def test_planner_fits_14b_720p_in_8_gib_with_block_chunks():
    plan = plan_memory(SIZES_14B, WORK_720P, 8)
    assert (plan.offload, plan.cfg, plan.ffn_chunk) == ("layer", "sequential", None)
    assert plan.block_chunk is not None and plan.block_chunk % CHUNK_ALIGN == 0
    assert plan.block_chunk < WORK_720P.tokens
    estimate = dict(plan.estimate_gib)
    assert estimate["denoise"] <= 8 and max(estimate.values()) <= 8
    # The whole-frame decode of 720p x 81 does not fit 8 GiB; four spatial bands one after another do
    # (exact up to conv rounding), so the plan needs no lossy tiled decode.
    assert plan.decode == "bands4" and not plan.lossy and "block_chunk=" in plan.describe()
    assert (
        estimate["decode"] < stage_peaks(SIZES_14B, WORK_720P, replace(plan, decode="frames"))["decode"] / GIB
    )
    # Block chunks cut the denoise estimate below the FFN-chunked plan's (5 whole [S, dim] tensors
    # at the attention instead of about 10).
    ffn_only = MemoryPlan(offload="layer", cfg="sequential", ffn_chunk=plan.block_chunk, decode="bands4")
    assert (
        stage_peaks(SIZES_14B, WORK_720P, plan)["denoise"]
        < stage_peaks(SIZES_14B, WORK_720P, ffn_only)["denoise"] - 2 * GIB
    )
    # 12 GiB needs no chunks at all; the 24 GiB plan keeps CFG batched.
    assert plan_memory(SIZES_14B, WORK_720P, 12).block_chunk is None


def test_planner_error_names_budget_and_minimum():
    with pytest.raises(
        ValidationError, match=r"gpu_memory_gb = 4: too small .*block_chunk=\d+.* needs about 5\.\d+ GiB"
    ):
        plan_memory(SIZES_14B, WORK_720P, 4)
    with pytest.raises(ValidationError, match=r"gpu_memory_gb = 2: too small .* needs about \d+\.\d+ GiB"):
        plan_memory(SIZES_14B, WORK_720P, 2)
    with pytest.raises(ValidationError, match="block_chunk = 0: must be a positive integer"):
        MemoryPlan(block_chunk=0)
    with pytest.raises(ValidationError, match="must be a number > 0"):
        plan_memory(SIZES_14B, WORK_720P, -1)
    with pytest.raises(ValidationError, match="offload = 'disk': allowed values are none, model, layer"):
        MemoryPlan(offload="disk")


def test_stage_peaks_record_nothing_off_cuda():
    peaks = StagePeaks(CPU)
    with peaks.stage("denoise"):
        pass
    assert peaks.gib == {}


# ---- through the pipeline (the embedded tiny default model) ----


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=11, progress=False)


def test_pipeline_offload_modes_are_exact(pipe):
    resident = pipe("a red ball", **CALL)
    assert resident.args["memory_plan"]["offload"] == "none"
    # Offload moves bytes, never changes a GEMM's shape: the same computation, so the same SHAs.
    for mode in ("layer", "model"):
        result = pipe("a red ball", offload=mode, **CALL)
        assert result.latents_sha256 == resident.latents_sha256, mode
        assert result.frames_sha256 == resident.frames_sha256, mode
        assert result.args["memory_plan"]["offload"] == mode
        if mode == "layer":  # the DiT's stream slots do not outlive the denoise stage
            assert pipe.placement.stream.device_bytes == 0
    again = pipe("a red ball", offload="none", **CALL)  # and back: released, resident again
    assert again.frames_sha256 == resident.frames_sha256
    assert isinstance(pipe.placement, OffloadPlacement) and pipe.placement.offload == "none"


def test_pipeline_frames_decode_is_bitwise_the_full_decode(pipe):
    full = pipe("a blue cube", decode="full", **CALL)
    frames = pipe("a blue cube", decode="frames", **CALL)
    assert frames.frames_sha256 == full.frames_sha256  # diffusers' own per-frame loop: same shapes, same bits
    assert frames.args["memory_plan"]["decode"] == "frames" and not frames.args["memory_plan"]["lossy"]


def test_pipeline_band_decode_equals_the_full_decode(pipe):
    full = pipe("a blue cube", decode="full", **CALL)
    for mode in ("bands2", "bands4"):
        banded = pipe("a blue cube", decode=mode, **CALL)
        assert banded.latents_sha256 == full.latents_sha256
        # Narrower convs round differently: uint8 frames at most one level apart, rarely.
        diff = np.abs(banded.frames.astype(np.int16) - full.frames.astype(np.int16))
        assert banded.frames.shape == full.frames.shape and diff.max() <= 1 and (diff > 0).mean() < 1e-3
        assert banded.args["memory_plan"]["decode"] == mode and not banded.args["memory_plan"]["lossy"]


def test_pipeline_sequential_cfg_and_ffn_chunks_stay_within_rounding(pipe):
    batched = pipe("a green cone", **CALL)
    chunked = pipe("a green cone", cfg="sequential", ffn_chunk=5, **CALL)
    # Other GEMM shapes (batch 1, 5-token FFN chunks): fp32 rounding that two guided steps of the
    # trained model carry to ~2e-5 (test_denoise_loop), hence its 1e-4.
    torch.testing.assert_close(chunked.latents, batched.latents, atol=1e-4, rtol=1e-4)
    assert (
        chunked.args["memory_plan"]["cfg"] == "sequential" and chunked.args["memory_plan"]["ffn_chunk"] == 5
    )


def test_pipeline_budget_too_small_fails_before_any_denoising(pipe):
    stages = []

    class Recorder:
        def stage(self, name, total):
            stages.append(name)

        def advance(self, units=1):
            pass

        def close(self):
            pass

    call = {**CALL, "progress": Recorder()}
    with pytest.raises(ValidationError, match=r"gpu_memory_gb = 1e-06: too small .* needs about"):
        pipe("a red ball", gpu_memory_gb=1e-6, **call)
    assert stages == []
    planned = pipe("a red ball", gpu_memory_gb=64, **CALL)
    assert (
        planned.args["memory_plan"]["budget_gib"] == 64 and planned.args["memory_plan"]["offload"] == "none"
    )
    assert planned.memory == {}  # CPU: nothing measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_offload_equals_resident_and_holds_two_blocks():
    resident = tiny_expert(0).cuda()
    streamed = copy.deepcopy(resident).cpu()
    x, t, text = (v.cuda() for v in tiny_inputs())
    expected = resident(
        x,
        t,
        text,
        attention=select_attention("sdpa", device=torch.device("cuda"), dtype=torch.float32, head_dim=16),
    )
    placement = OffloadPlacement("layer", experts=[streamed], device="cuda", **side_modules())
    attention = select_attention("sdpa", device=torch.device("cuda"), dtype=torch.float32, head_dim=16)
    for _ in range(2):  # the second forward reuses the slots, waiting for the first's last blocks
        out = streamed(x, t, text, attention=attention, settings=streamed_by(placement))
        assert torch.equal(out, expected)
    # Page-locked by cudaHostRegister (torch's is_pinned() only knows its own pinned allocator).
    assert all(b.registered for g in placement.stream._groups.values() for b in g._pinned)
    assert all(g._pinned for g in placement.stream._groups.values())
    placement.release()
    assert streamed.blocks[0].ffn.net[2].weight.is_cuda


def test_planner_for_two_experts_prefetches_only_when_two_fit():
    import dataclasses

    sizes = dataclasses.replace(SIZES_14B, expert_bytes=(int(26.6 * GIB),) * 2)
    both = plan_memory(sizes, WORK_720P, 72)  # two experts + text + VAE do not fit, two experts do
    assert (both.offload, both.prefetch_experts) == ("model", True)
    one = plan_memory(sizes, WORK_720P, 48)  # one expert at a time fits
    assert (one.offload, one.prefetch_experts) == ("model", False)
    assert plan_memory(sizes, WORK_720P, 24).offload == "layer"


def test_tiled_decode_is_recorded_as_lossy(pipe):
    result = pipe("a red ball", decode="tiled", **CALL)
    assert result.args["memory_plan"]["lossy"] is True
    assert "decode=tiled (lossy)" in MemoryPlan(decode="tiled").describe()


def test_explicit_choices_override_a_budgeted_plan_and_get_its_estimate(pipe):
    planned = pipe("a red ball", gpu_memory_gb=64, **CALL).args["memory_plan"]
    forced = pipe("a red ball", gpu_memory_gb=64, cfg="sequential", ffn_chunk=3, **CALL).args["memory_plan"]
    assert (forced["cfg"], forced["ffn_chunk"], forced["budget_gib"]) == ("sequential", 3, 64)
    assert forced["estimate_gib"]["denoise"] < planned["estimate_gib"]["denoise"]
    with pytest.raises(ValidationError, match="cfg = 'parallel'"):
        pipe("a red ball", cfg="parallel", **CALL)


def test_release_to_the_host_leaves_plain_host_tensors():
    expert = tiny_expert(0)
    expected = forward(expert)
    placement = OffloadPlacement("layer", experts=[expert], device=CPU, **side_modules())
    placement.release(to=CPU)
    assert placement.stream is None
    expert.fuse_projections()  # what compile_blocks does after such a release
    assert torch.allclose(forward(expert), expected, atol=1e-5)  # stacked q/k/v: fp32 rounding only
    assert placement.log[-1] == ("release", "layer")


@pytest.mark.parametrize("offload", ["model", "layer"])
def test_two_expert_denoise_loop_with_offload_equals_resident(offload):
    """The real loop (pipelines.denoise) over a Wan2.2-style plan: expert 0 above the boundary,
    expert 1 below; offloaded experts give the resident latents exactly, each expert moved once."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from mmgen.parallel.layout import ParallelLayout
    from mmgen.progress import NullProgress
    from pipelines.denoise import Conditioning, DenoiseModels, TextBranch, denoise, split_branches

    def run(experts, placement):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(5)
        steps = plan_steps(scheduler.timesteps, (5.0, 3.0), boundary_timestep=600.0)
        assert [s.expert for s in steps] == [0, 0, 0, 1, 1]
        text = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(5))
        both = TextBranch(text=text, metadata=WanDiT.build_attention_metadata())
        conditioning = Conditioning(both, split_branches(both, lambda row: WanDiT.build_attention_metadata()))
        settings = streamed_by(placement)
        models = DenoiseModels(
            tuple(experts), ATTENTION, ParallelLayout.single(), placement, torch.float32, settings
        )
        noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(6))
        return denoise(noise, steps, scheduler, conditioning, models, progress=NullProgress())

    from pipelines.denoise import ResidentPlacement

    resident = [tiny_expert(1), tiny_expert(2)]
    experts = copy.deepcopy(resident)
    expected = run(resident, ResidentPlacement())
    placement = OffloadPlacement(
        offload, experts=experts, device=CPU, prefetch_experts=True, **side_modules()
    )
    assert torch.equal(run(experts, placement), expected)  # moved weights, same shapes: same bits
    if offload == "model":
        assert placement.log == [("load", "expert0"), ("prefetch", "expert1"), ("park", "expert0")]
