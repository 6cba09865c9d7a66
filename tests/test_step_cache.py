"""Lossy step acceleration (issue 20): step caching and CFG truncation in the one denoise loop."""

from __future__ import annotations

import textwrap

import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import fp8_block_bytes, fp8_layers_for
from mmgen.progress import NullProgress
from pipelines.denoise import DenoiseModels, DenoiseOptions, denoise, plan_steps, predict_noise
from pipelines.step_cache import (
    BranchCache,
    check_cfg_truncation,
    guided_steps,
    resolve_accel,
    reuse_schedule,
)
from pipelines.wan_t2v import WanT2VPipeline

# Tiny requests: the point is which calls run and which bits come out, not the pictures.
REQUEST = dict(height=32, width=48, num_frames=5, num_inference_steps=6, guidance_scale=5.0, seed=7)
REQUEST["max_sequence_length"] = 16


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


class CountingModel:
    """Wraps an expert: records the batch of every call (so a test sees which calls ran)."""

    def __init__(self, model) -> None:
        self.model, self.batches = model, []
        self.config, self.condition_embedder = model.config, model.condition_embedder

    def __call__(self, x, *args, **kwargs):
        self.batches.append(x.shape[0])
        return self.model(x, *args, **kwargs)


def _setup(pipe, steps=6, experts=1):
    text, lens = pipe.encode_text(["a red circle moves left", ""], 16)
    conditioning = pipe.conditioning(text, lens)
    scheduler = type(pipe.components.scheduler).from_config(pipe.components.scheduler.config)
    scheduler.set_timesteps(steps)
    scheduler.set_begin_index(0)
    boundary = None if experts == 1 else float(scheduler.timesteps[steps // 2 - 1])
    plan = plan_steps(scheduler.timesteps, (5.0,) * experts, boundary)
    noise = torch.randn(pipe.latents_shape(32, 48, 5), generator=torch.Generator().manual_seed(3))
    return conditioning, scheduler, plan, noise


def _loop(pipe, options, experts=(None,), steps=6, reused=None):
    """The loop over counting experts; experts=(None, None) plans two experts sharing the weights."""
    conditioning, scheduler, plan, noise = _setup(pipe, steps, len(experts))
    wrapped = tuple(CountingModel(pipe.transformer) for _ in experts)
    models = DenoiseModels(wrapped, pipe.attention_for("auto"), pipe.layout, pipe.placement, pipe.dtype)
    out = denoise(
        noise, plan, scheduler, conditioning, models, options=options, progress=NullProgress(), reused=reused
    )
    return out, wrapped


def _old_loop(pipe, steps=6):
    """The loop as it was before the lossy options: predict_noise then the scheduler, every step."""
    conditioning, scheduler, plan, latents = _setup(pipe, steps)
    models = DenoiseModels(
        (pipe.transformer,), pipe.attention_for("auto"), pipe.layout, pipe.placement, pipe.dtype
    )
    for step in plan:
        prediction = predict_noise(latents, step, conditioning, models, DenoiseOptions())
        latents = scheduler.step(prediction, step.timestep, latents, return_dict=False)[0]
    return latents


def _signals(changes):
    """Signals whose relative L1 change from step i-1 to step i is changes[i - 1] exactly."""
    signals = [torch.full((4,), 2.0)]
    for change in changes:
        signals.append(signals[-1] * (1 + change))
    return signals


def test_schedule_never_reuses_first_last_or_an_experts_first_step():
    even = _signals([0.01] * 7)  # 8 steps, every change one mean step
    assert reuse_schedule(even, [0] * 8, threshold=100.0) == (False, *[True] * 6, False)
    assert reuse_schedule(even, [0, 0, 0, 0, 1, 1, 1, 1], threshold=100.0) == (
        *(False, True, True, True, False, True, True, False),
    )
    assert not any(reuse_schedule(even, [0] * 8, threshold=0.0))  # 0: always compute
    # Accumulation: 2.5 mean steps reuse two steps, then one computes (and resets the sum).
    assert reuse_schedule(even, [0] * 8, threshold=2.5) == (
        False,
        True,
        True,
        False,
        True,
        True,
        False,
        False,
    )
    assert reuse_schedule(even, [0] * 8, threshold=1.5) == (
        False,
        True,
        False,
        True,
        False,
        True,
        False,
        False,
    )


def test_schedule_reuses_where_the_signal_moves_slowly_on_any_scale():
    changes = [0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 0.7]  # the mean over steps 1-6 is 1
    expected = (False, True, True, False, True, False, False, False)
    assert reuse_schedule(_signals(changes), [0] * 8, threshold=1.4) == expected
    # Normalized by the request's own mean change: a model whose embedding moves 100x less agrees.
    small = [c / 100 for c in changes]
    assert reuse_schedule(_signals(small), [0] * 8, threshold=1.4) == expected
    assert not any(reuse_schedule([torch.ones(4)] * 5, [0] * 5, threshold=10.0))  # no change at all


def test_settings_are_checked_with_their_names():
    with pytest.raises(ValidationError, match="step_cache = -0.1"):
        DenoiseOptions(step_cache=-0.1)
    with pytest.raises(ValidationError, match=r"cfg_truncation = 0: must be a fraction in \(0, 1\]"):
        DenoiseOptions(cfg_truncation=0)
    with pytest.raises(ValidationError, match="cfg_truncation = 1.5"):
        check_cfg_truncation(1.5)
    with pytest.raises(ValidationError, match="accel 'turbo': allowed values are fast, fastest"):
        resolve_accel("turbo", None, None)
    with pytest.raises(ValidationError, match="step_cache = 0.5 conflicts with accel 'fast'"):
        resolve_accel("fast", 0.5, None)
    fastest = resolve_accel("fastest", None, None)
    assert (fastest.step_cache, fastest.cfg_truncation) == (2.5, 0.6)
    assert (fastest.fp8_linear, fastest.fp8_attention) is not None
    assert fastest.from_preset == {"fp8_linear", "fp8_attention"}
    explicit = resolve_accel("fast", None, None, fp8_linear=True)
    assert explicit.fp8_linear and explicit.from_preset == {"fp8_attention"}
    with pytest.raises(ValidationError, match="fp8_attention = False conflicts with accel 'fast'"):
        resolve_accel("fast", None, None, fp8_attention=False)
    with pytest.raises(ValidationError, match="fp8_linear = 'yes': must be true, false or null"):
        resolve_accel(None, None, None, fp8_linear="yes")
    plain = resolve_accel(None, None, None, fp8_linear=False)
    assert plain == resolve_accel(None, None, None) and plain.fp8_linear is None and not plain.from_preset
    assert [guided_steps(f, 50) for f in (None, 1.0, 0.3, 0.5, 0.01)] == [50, 50, 15, 25, 1]


def test_off_threshold_zero_and_fraction_one_are_the_loop_of_today_bit_for_bit(pipe):
    today = _old_loop(pipe)
    off, (model,) = _loop(pipe, DenoiseOptions())
    assert model.batches == [2] * 6
    zero, (model,) = _loop(pipe, DenoiseOptions(step_cache=0.0))
    assert model.batches == [2] * 6
    full, _ = _loop(pipe, DenoiseOptions(cfg_truncation=1.0))
    both, _ = _loop(pipe, DenoiseOptions(step_cache=0.0, cfg_truncation=1.0, cfg="batch"))
    for got in (off, zero, full, both):
        assert torch.equal(got, today)  # the same calls with the same shapes: identical bits


def test_step_cache_skips_model_calls_and_reports_them(pipe):
    reused: list[int] = []
    cached, (model,) = _loop(pipe, DenoiseOptions(step_cache=10.0), reused=reused)
    # A huge threshold: every step but the first and last reuses the first step's outputs.
    assert reused == [1, 2, 3, 4]
    assert model.batches == [2, 2]
    exact = _old_loop(pipe)
    assert not torch.equal(cached, exact)
    assert torch.isfinite(cached).all()


def test_step_cache_keeps_one_cache_per_expert(pipe):
    reused: list[int] = []
    _, (high, low) = _loop(pipe, DenoiseOptions(step_cache=10.0), experts=(None, None), reused=reused)
    # Steps 0-2 on expert 0, 3-5 on expert 1: each expert's first step computes, the last step too.
    assert reused == [1, 2, 4]
    assert high.batches == [2] and low.batches == [2, 2]


def test_cfg_truncation_runs_the_conditional_branch_alone_after_the_fraction(pipe):
    truncated, (model,) = _loop(pipe, DenoiseOptions(cfg_truncation=0.5))
    assert model.batches == [2, 2, 2, 1, 1, 1]
    sequential, (model,) = _loop(pipe, DenoiseOptions(cfg_truncation=0.5, cfg="sequential"))
    assert model.batches == [1] * 6 + [1] * 3
    # The guided steps as batch 2 vs two batch-1 calls: other GEMM shapes, fp32 rounding that the
    # trained model's guided steps carry to ~2e-5 on a CPU whose BLAS rounds them apart (equal to
    # 1e-6 on the dev machine): test_denoise_loop's 1e-4, far below truncation's own effect (next line).
    torch.testing.assert_close(sequential, truncated, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(truncated, _old_loop(pipe), atol=1e-4)


def test_truncated_steps_reuse_only_the_conditional_branch(pipe):
    reused: list[int] = []
    _, (model,) = _loop(pipe, DenoiseOptions(step_cache=10.0, cfg_truncation=0.5), reused=reused)
    assert reused == [1, 2, 3, 4] and model.batches == [2, 1]


def test_branch_cache_is_per_expert_and_branch():
    cache = BranchCache()
    assert cache.load(0, 1) is None
    cond, uncond = torch.zeros(1), torch.ones(1)
    cache.store(0, (cond, uncond))
    assert cache.load(0, 2) == (cond, uncond) and cache.load(0, 1) == (cond,)
    assert cache.load(1, 1) is None


def test_pipeline_records_the_settings_and_off_is_unchanged(pipe):
    plain = pipe("a red circle", progress=False, **REQUEST)
    assert not {"step_cache", "cfg_truncation", "accel", "step_cache_reused"} & set(plain.args)
    exact = pipe("a red circle", progress=False, step_cache=0.0, cfg_truncation=1.0, **REQUEST)
    assert exact.frames_sha256 == plain.frames_sha256
    assert exact.args["step_cache_reused"] == [] and exact.args["cfg_truncation"] == 1.0
    fast = pipe("a red circle", progress=False, accel="fastest", **REQUEST)
    assert fast.args["accel"] == "fastest" and fast.args["accel_settings"]["step_cache"] == 2.5
    assert (fast.args["step_cache"], fast.args["cfg_truncation"]) == (2.5, 0.6)
    assert fast.frames_sha256 != plain.frames_sha256
    # On the CPU the preset's FP8 parts are skipped, said so, and the frames are its caching +
    # truncation alone (what `fastest` made before FP8 joined it).
    assert fast.args["accel_settings"]["fp8_linear"] is True and fast.args["accel_settings"]["fp8_attention"]
    assert set(fast.args["accel_skipped"]) == {"fp8_linear", "fp8_attention"}
    assert "device cpu" in fast.args["accel_skipped"]["fp8_linear"]
    assert not {"fp8_linear", "fp8_linear_layers", "fp8_attention"} & set(fast.args)
    assert "e4m3" not in fast.fingerprint["attention_providers"]["transformer.self_attn"]
    spelled = pipe("a red circle", progress=False, step_cache=2.5, cfg_truncation=0.6, **REQUEST)
    assert spelled.frames_sha256 == fast.frames_sha256
    # an explicit FP8 setting is applied (emulated on the CPU), the preset's other FP8 part still skipped
    both = pipe("a red circle", progress=False, accel="fastest", fp8_linear=True, **REQUEST)
    assert both.args["fp8_linear"] is True and list(both.args["accel_skipped"]) == ["fp8_attention"]
    assert both.frames_sha256 != fast.frames_sha256
    with pytest.raises(ValidationError, match="conflicts with accel 'fast'"):
        pipe("a red circle", progress=False, accel="fast", step_cache=0.5, **REQUEST)


def test_cache_never_carries_between_requests_or_jobs_of_a_render(
    pipe, tmp_path, mmgen_cache_dir, monkeypatch
):
    from mmgen.render.runner import run_render
    from mmgen.render.schema import load_render_file

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    alone = pipe("a blue square", progress=False, step_cache=10.0, **REQUEST)
    pipe("something else entirely", progress=False, step_cache=10.0, **{**REQUEST, "seed": 99})
    again = pipe("a blue square", progress=False, step_cache=10.0, **REQUEST)
    assert again.frames_sha256 == alone.frames_sha256

    def render(jobs: str, out: str):
        path = tmp_path / f"{out}.yaml"
        path.write_text(
            textwrap.dedent(
                """\
                model: default
                device: cpu
                dtype: float32
                defaults: {height: 32, width: 48, num_frames: 5, num_inference_steps: 6,
                           guidance_scale: 5.0, max_sequence_length: 16, step_cache: 10.0}
                seeds: {fixed: 7}
                jobs:
                """
            )
            + jobs
        )
        plan = load_render_file(path, output_dir=tmp_path / out)
        summary = run_render(plan, show_progress=False, pipeline_factory=lambda _plan: pipe)
        return {o.job.label: o.record["frames_sha256"] for o in summary.outcomes}

    single = render("  - {name: blue, prompt: a blue square}\n", "single")
    several = render(
        "  - {name: other, prompt: a green field, seed: 3}\n  - {name: blue, prompt: a blue square}\n",
        "several",
    )
    assert several["blue"] == single["blue"] == alone.frames_sha256


def test_generate_flags_reach_the_pipeline_and_bad_values_fail_before_loading(
    mmgen_cache_dir, tmp_path, monkeypatch, capsys
):
    from mmgen.cli import main

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    out = str(tmp_path / "cat.png")
    common = ["generate", "a cat", "--out", out, "--steps", "5", "--height", "32", "--width", "48"]
    assert main([*common, "--accel", "fastest"]) == 0
    text = capsys.readouterr().out
    assert "accel: fastest" in text and "step_cache: 2.5" in text and "cfg_truncation: 0.6" in text
    assert "step_cache_reused: " in text
    for flags, message in (
        (["--accel", "turbo"], "--accel: accel 'turbo': allowed values are fast, fastest"),
        (["--step-cache", "-1"], "--step-cache: step_cache = -1.0"),
        (["--cfg-truncation", "0"], "--cfg-truncation: cfg_truncation = 0.0"),
        (["--accel", "fast", "--cfg-truncation", "0.5"], "conflicts with accel 'fast'"),
    ):
        with pytest.raises(ValidationError, match=message):
            _generate_checks([*common, *flags])


def _generate_checks(argv):
    """The generate command's checks before any model load (the flags' parse and validation)."""
    from mmgen.cli import build_parser, generate_request

    generate_request(build_parser().parse_args(argv))


def test_render_file_fields_are_checked_with_the_pipeline_rules(tmp_path):
    from mmgen.render.schema import RenderConfigError, load_render_file

    path = tmp_path / "r.yaml"
    path.write_text(
        "model: default\njobs:\n  - {prompt: a cat, step_cache: -1}\n  - {prompt: a dog, accel: turbo}\n"
        "  - {prompt: a cow, cfg_truncation: 1.5}\n  - {prompt: ok, accel: fast, step_cache: 1.5}\n"
    )
    with pytest.raises(RenderConfigError) as caught:
        load_render_file(path, output_dir=tmp_path / "out")
    text = "\n".join(caught.value.problems)
    assert "step_cache = -1" in text and "accel 'turbo'" in text and "cfg_truncation = 1.5" in text
    # the request value checks the accel conflict too, at load time as the CLI and the Python call do
    assert "jobs[3]: step_cache = 1.5 conflicts with accel 'fast'" in text
    assert len(caught.value.problems) == 4


def lossy_latents(layout, model_dir) -> torch.Tensor:
    """Final latents of a cached, CFG-truncated generation (layout None = one process, sequential CFG)."""
    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout)
    kwargs = {**REQUEST, "step_cache": 10.0, "cfg_truncation": 0.5}
    result = pipe("a red fox", progress=False, **({"cfg": "sequential"} if layout is None else {}), **kwargs)
    assert result.args["step_cache_reused"] == [1, 2, 3, 4]  # every rank took the same decisions
    return result.latents


@pytest.mark.parametrize("sp, cfg", [(1, True), (2, False)], ids=["cfg2", "ulysses2"])
def test_ranks_agree_on_cached_and_truncated_steps(sp, cfg, default_model_dir):
    import parallel_workers

    from mmgen.parallel.layout import ParallelConfig

    single = lossy_latents(None, default_model_dir)
    config = ParallelConfig(sp=sp, cfg=cfg)
    latents = parallel_workers.run_forked(lossy_latents, config, default_model_dir)
    # Sharded or per-branch GEMMs of other shapes than one process's: fp32 rounding through the trained
    # model, the 1e-4 of test_parallel_generate (the same decisions on every rank are asserted above).
    torch.testing.assert_close(latents, single, atol=1e-4, rtol=1e-4)


def test_preset_fp8_parts_are_skipped_where_they_would_not_run_natively(monkeypatch):
    """The CUDA-side rules of pipelines.fp8_choice.fp8_obstacles, read on the CPU with stand-in facts."""
    from types import SimpleNamespace

    import pipelines.fp8_choice as fp8_choice
    from mmgen.models.wan import WanConfig

    def obstacles(
        config,
        *,
        fp8_gpu=True,
        dtype=torch.bfloat16,
        offload="none",
        provider="fa3",
        single=True,
        budget=None,
    ):
        monkeypatch.setattr(fp8_choice, "fp8_gemm_supported", lambda device: fp8_gpu)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        attention = SimpleNamespace(name="flash", provider=provider)
        # budget (GiB, estimate GiB): a budgeted plan whose largest stage estimate is given
        plan = SimpleNamespace(
            offload=offload,
            budget_gib=None if budget is None else budget[0],
            estimate_gib=None if budget is None else (("denoise", budget[1]),),
        )
        kinds = fp8_layers_for(config.dim) if config.dim >= 1536 else frozenset()
        experts = (SimpleNamespace(config=config),)
        context = fp8_choice.Fp8Context(torch.device("cuda"), dtype, config, experts, single, plan, attention)
        return fp8_choice.fp8_obstacles(context, kinds)

    wan13, wan14 = WanConfig.wan21_t2v_1_3b(), WanConfig.wan21_t2v_14b()
    assert obstacles(wan13) == {} and obstacles(wan14) == {}
    assert list(obstacles(wan13, fp8_gpu=False)) == ["fp8_linear"]
    assert "8.0 < 8.9" in obstacles(wan13, fp8_gpu=False)["fp8_linear"]
    assert "bfloat16" in obstacles(wan13, dtype=torch.float16)["fp8_linear"]
    assert "offload 'layer'" in obstacles(wan14, offload="layer")["fp8_linear"]
    # 14B's FP8 copies (all but cross k/v): 40 blocks x 299 MB = 11.14 GiB beside the resident weights.
    assert fp8_block_bytes(5120, 13824, fp8_layers_for(5120)) * 40 / 2**30 == pytest.approx(11.14, abs=0.01)
    assert obstacles(wan14, budget=(48, 30)) == {}
    assert "no room for the FP8 weight copies (11.14 GiB)" in obstacles(wan14, budget=(48, 40))["fp8_linear"]
    assert list(obstacles(wan13, provider="fa2")) == ["fp8_attention"]
    assert "one GPU" in obstacles(wan13, single=False)["fp8_attention"]
    tiny = WanConfig(num_attention_heads=4, attention_head_dim=32, ffn_dim=384, num_layers=2)
    assert set(obstacles(tiny)) == {
        "fp8_linear",
        "fp8_attention",
    }  # width 128, head dim 32: not measured / no kernel
