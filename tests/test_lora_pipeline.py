"""LoRAs through the faces: the pipeline against diffusers' WanPipeline.load_lora_weights on the embedded
default model, switching per call, the distill-4step preset, `mmgen generate --lora`, render YAML
`loras:` (one model load for jobs with different LoRAs) and `mmgen ab` with LoRAs."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch
from lora_cases import diffusers_lora, musubi_lora, save, wan_lora
from safetensors import safe_open
from wan_cases import diffusers_wan_pipeline

import pipelines.run
from mmgen.cli import main as cli_main
from mmgen.default_model import TRANSFORMER
from mmgen.errors import ValidationError
from pipelines.presets import PRESETS
from pipelines.wan_t2v import WanT2VPipeline

PROMPT = "a red fox running through a snowy forest at sunset"
NEGATIVE = "blurry dark"
KWARGS = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=4.0)
BUILDERS = {"wan": wan_lora, "musubi": musubi_lora, "diffusers": diffusers_lora}
# Max abs latent difference between a LoRA applied fused and unfused (or by diffusers/PEFT): the same
# math through differently shaped GEMMs, fp32 rounding that two guided steps of the trained default
# model carry to 1.1e-5..1.7e-5 here (latents up to ~3) and a CPU whose BLAS picks other kernels per
# shape may carry further: the 1e-4 of the pipeline parity tests. The LoRAs move the latents by ~9.
LORA_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ours(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return diffusers_wan_pipeline(default_model_dir)


@pytest.fixture(scope="module")
def lora_files(ours, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    return {
        name: save(folder / f"{name}.safetensors", *builder(ours.transformer, seed=index))
        for index, (name, builder) in enumerate(BUILDERS.items())
    }


def _noise(pipe, seed=7):
    shape = pipe.latents_shape(KWARGS["height"], KWARGS["width"], KWARGS["num_frames"])
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_pipeline_matches_diffusers_load_lora_weights(ours, reference, lora_files, fmt):
    path = lora_files[fmt]
    noise = _noise(ours)
    result = ours(PROMPT, NEGATIVE, latents=noise, progress=False, lora=f"{path}:0.8", **KWARGS)
    reference.load_lora_weights(str(path), adapter_name=fmt, low_cpu_mem_usage=False)
    try:
        reference.set_adapters([fmt], adapter_weights=[0.8])
        latents = reference(PROMPT, NEGATIVE, latents=noise.clone(), output_type="latent", **KWARGS).frames
        pictures = reference(PROMPT, NEGATIVE, latents=noise.clone(), output_type="pil", **KWARGS).frames[0]
    finally:
        reference.unload_lora_weights()
    # Fused W + s*B@A (ours, one batch-2 CFG call) vs PEFT's W x + s*B(A x) (diffusers, cond then uncond):
    # the same math through differently shaped GEMMs. With the trained default model, rounding alone
    # reaches ~1.4e-5 even without a LoRA (~1.3e-5 with one), well below what the LoRA changes.
    assert (result.latents - latents).abs().max().item() <= LORA_TOLERANCE
    expected = np.stack([np.asarray(picture) for picture in pictures])  # diffusers' own uint8 frames
    np.testing.assert_array_equal(ours.decode(latents), expected)  # same latents: identical uint8 frames
    # End to end the latents agree to ~1e-5, so (as without a LoRA, test_pipeline_parity) a handful of
    # values may land on the other side of a uint8 rounding edge.
    assert np.abs(result.frames.astype(int) - expected.astype(int)).max() <= 1
    assert (result.frames == expected).mean() > 0.999
    report = result.args["loras"]
    assert report["mode"] == "fused" and report["files"][0]["format"] == fmt
    assert result.fingerprint["loras"]["files"][0]["strength"] == 0.8


def test_switching_loras_per_call_restores_the_base_model(ours, lora_files):
    noise = _noise(ours, seed=3)
    base = ours(PROMPT, latents=noise, progress=False, **KWARGS)
    assert "loras" not in base.args and "loras" not in base.fingerprint
    weights = {k: v.clone() for k, v in ours.transformer.state_dict().items()}
    fused = ours(
        PROMPT, latents=noise, progress=False, lora=[lora_files["wan"], lora_files["diffusers"]], **KWARGS
    )
    unfused = ours(
        PROMPT,
        latents=noise,
        progress=False,
        lora=[lora_files["wan"], lora_files["diffusers"]],
        lora_mode="unfused",
        **KWARGS,
    )
    # (W + s*B@A) x vs W x + s*B(A x): differently shaped GEMMs, rounding only (~1e-5 with trained weights)
    assert (fused.latents - unfused.latents).abs().max().item() <= LORA_TOLERANCE
    assert (fused.latents - base.latents).abs().max().item() > 100 * LORA_TOLERANCE
    assert [f["format"] for f in unfused.args["loras"]["files"]] == ["wan", "diffusers"]
    again = ours(PROMPT, latents=noise, progress=False, **KWARGS)
    assert again.latents_sha256 == base.latents_sha256 and again.frames_sha256 == base.frames_sha256
    for key, value in ours.transformer.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_bad_loras_fail_before_any_denoising(ours, lora_files, tmp_path, monkeypatch):
    def no_denoise(*args, **kwargs):
        raise AssertionError("denoising started")

    monkeypatch.setattr(pipelines.run, "denoise", no_denoise)  # the loop pipelines.run runs
    wide = save(tmp_path / "wide.safetensors", *wan_lora(ours.transformer, extras=False))
    state, _ = wan_lora(ours.transformer, extras=False)
    state["diffusion_model.blocks.0.self_attn.q.lora_down.weight"] = torch.randn(4, 48)
    save(wide, state)
    i2v = save(
        tmp_path / "i2v.safetensors",
        {
            "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": torch.randn(2, 32),
            "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": torch.randn(32, 2),
        },
    )
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(lora_files["wan"].read_bytes()[:-64])
    cases = [
        (wide, "different model size"),
        (i2v, "I2V LoRA"),
        (truncated, "cut.safetensors"),
        (tmp_path / "none.safetensors", "not found"),
        (f"{lora_files['wan']}@1", "expert 1 requested"),
    ]
    for lora, message in cases:
        with pytest.raises(Exception, match=message) as info:
            ours(PROMPT, progress=False, lora=lora, **KWARGS)
        assert "\n" not in str(info.value)
    with pytest.raises(ValidationError, match="changed: its sha256 is"):
        ours(PROMPT, progress=False, lora={"path": str(lora_files["wan"]), "sha256": "0" * 64}, **KWARGS)
    with pytest.raises(ValidationError, match="lora_mode"):
        ours(PROMPT, progress=False, lora=lora_files["wan"], lora_mode="merged", **KWARGS)


def test_distill_preset_runs_the_lightx2v_schedule(ours):
    preset = PRESETS["distill-4step"]
    scheduler = preset.scheduler("cpu")
    assert torch.allclose(scheduler.timesteps, torch.tensor([1000.0, 937.5, 833.3333, 625.0]))
    assert torch.allclose(scheduler.sigmas, torch.tensor([1.0, 0.9375, 0.833333, 0.625, 0.0]))
    seen = []
    original = ours.transformer.forward

    def spy(latents, timestep, text, **kwargs):
        seen.append((float(timestep[0]), latents.shape[0]))
        return original(latents, timestep, text, **kwargs)

    ours.transformer.forward = spy
    try:
        result = ours(PROMPT, preset="distill-4step", progress=False, height=32, width=48, num_frames=5)
    finally:
        del ours.transformer.forward
    assert [t for t, _ in seen] == pytest.approx([1000.0, 937.5, 833.3333, 625.0])
    assert {batch for _, batch in seen} == {1}  # guidance 1: no CFG, one batch-1 call per step
    assert result.args["preset"] == "distill-4step" and result.args["num_inference_steps"] == 4
    assert result.args["guidance_scale"] == 1.0 and result.args["preset_settings"]["shift"] == 5.0
    with pytest.raises(ValidationError, match="conflicts with preset 'distill-4step'"):
        ours(PROMPT, preset="distill-4step", num_inference_steps=8, progress=False)
    with pytest.raises(ValidationError, match="allowed values are distill-4step"):
        ours(PROMPT, preset="turbo", progress=False)


def test_generate_cli_prints_the_lora_report(mmgen_cache_dir, lora_files, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    out = tmp_path / "x.png"
    common = ["generate", "a cat", "--frames", "1", "--height", "32", "--width", "32", "--steps", "1"]
    code = cli_main(
        [*common, "--out", str(out), "--lora", f"{lora_files['wan']}:0.5", "--lora-mode", "unfused"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("lora: ")]
    # Every key of the file is counted: the all-zero norm deltas are ignored, all the others match.
    with safe_open(str(lora_files["wan"]), "pt") as lora:
        keys = list(lora.keys())
        zero = sum(not lora.get_tensor(key).any() for key in keys)
    assert zero == 6 * TRANSFORMER.num_layers  # per block: 4 q/k norms, norm3 weight and bias
    matched = f"expert 0: {len(keys) - zero}/{len(keys)} keys matched"
    assert len(lines) == 1 and "strength 0.5" in lines[0] and matched in lines[0]
    assert f"{zero} ignored ({zero} all-zero delta" in lines[0] and "lora_mode: unfused" in captured.out
    code = cli_main([*common, "--out", str(out), "--lora", str(tmp_path / "missing.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "missing.safetensors" in err and "not found" in err
    code = cli_main([*common, "--out", str(out), "--preset", "distill-4step"])
    err = capsys.readouterr().err
    assert code == 2 and "conflicts with preset" in err


RENDER = """\
    model: default
    device: cpu
    dtype: float32
    defaults:
      height: 16
      width: 16
      num_frames: 1
      num_inference_steps: 1
      guidance_scale: 1.0
      max_sequence_length: 16
      loras: ["{wan}:0.5"]
    jobs:
      - {{name: a, prompt: a cat}}
      - {{name: b, prompt: a cat, loras: [{{path: "{diffusers}", strength: 1.5}}], lora_mode: unfused}}
      - {{name: c, prompt: a cat, loras: []}}
"""


def test_render_yaml_loras_per_job_one_model_load(mmgen_cache_dir, lora_files, tmp_path, monkeypatch):
    from mmgen.render.manifest import MANIFEST_NAME, read_manifest
    from mmgen.render.runner import load_pipeline, run_render
    from mmgen.render.schema import load_render_file

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(RENDER.format(wan=lora_files["wan"], diffusers=lora_files["diffusers"])))
    plan = load_render_file(path, output_dir=tmp_path / "out")
    loads = []

    def factory(p):
        loads.append(p)
        return load_pipeline(p)

    run_render(plan, pipeline_factory=factory, show_progress=False)
    assert len(loads) == 1
    records = {r["job"]["name"]: r for r in read_manifest(tmp_path / "out" / MANIFEST_NAME)}
    assert all(r["status"] == "ok" for r in records.values())
    a, b, c = records["a"], records["b"], records["c"]
    assert a["args"]["loras"]["files"][0]["strength"] == 0.5 and a["fingerprint"]["loras"]["mode"] == "fused"
    assert b["args"]["loras"]["files"][0]["format"] == "diffusers" and b["args"]["loras"]["mode"] == "unfused"
    assert "loras" not in c["args"] and "loras" not in c["fingerprint"]
    assert len({a["frames_sha256"], b["frames_sha256"], c["frames_sha256"]}) == 3
    # The plan pins each LoRA's bytes: a changed file changes the job's request key (no stale resume).
    assert (
        a["request"]["lora"][0]["sha256"]
        == __import__("hashlib").sha256(lora_files["wan"].read_bytes()).hexdigest()
    )
    changed = tmp_path / "changed.safetensors"
    changed.write_bytes(lora_files["wan"].read_bytes())
    path.write_text(textwrap.dedent(RENDER.format(wan=changed, diffusers=lora_files["diffusers"])))
    before = load_render_file(path).request_key(load_render_file(path).jobs[0])
    save(changed, *wan_lora(load_pipeline(plan).transformer, seed=11))
    assert load_render_file(path).request_key(load_render_file(path).jobs[0]) != before
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(RENDER.format(wan="nowhere", diffusers=lora_files["diffusers"])))
    with pytest.raises(ValidationError, match=r"defaults\.loras.*not found: nowhere"):
        load_render_file(bad)


def test_ab_lora_variables_pinned_files_and_fingerprint_refusal(mmgen_cache_dir, ours, tmp_path, monkeypatch):
    from mmgen.render.ab import run_ab

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    lora = save(tmp_path / "l.safetensors", *wan_lora(ours.transformer, seed=9))
    config = tmp_path / "base.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            model: default
            device: cpu
            dtype: float32
            defaults: {height: 16, width: 16, num_frames: 1, num_inference_steps: 1, guidance_scale: 1.0,
                       max_sequence_length: 16}
            jobs:
              - {name: cat, prompt: a cat, seed: 1}
            """
        )
    )
    result = run_ab(config, sets=[f"loras=['{lora}']"], out_dir=tmp_path / "ab", show_progress=False)
    assert result.report["declared"] == ["lora"] and not result.report["refused"]
    # A LoRA file that changes after the baseline was rendered: the plan pins each file's sha256, so
    # the reused baseline is re-rendered with the new bytes rather than compared against stale frames.
    with_lora = tmp_path / "with.yaml"
    with_lora.write_text(
        config.read_text().replace(
            "max_sequence_length: 16}", f"max_sequence_length: 16, loras: ['{lora}']}}"
        )
    )
    from mmgen.render.ab import load_pair, undeclared_differences
    from mmgen.render.manifest import MANIFEST_NAME, read_manifest
    from mmgen.render.runner import run_render

    base, _, out = load_pair(with_lora, None, ["lora_mode=unfused"], tmp_path / "ab2")
    run_render(base, save_frames=True, show_progress=False)
    save(lora, *wan_lora(ours.transformer, seed=10))
    again = run_ab(with_lora, sets=["lora_mode=unfused"], out_dir=out, reuse=True, show_progress=False)
    assert again.report["declared"] == ["lora_mode"] and not again.report["refused"]
    new_sha = __import__("hashlib").sha256(lora.read_bytes()).hexdigest()
    for side in ("base", "candidate"):
        (record,) = [r for r in read_manifest(out / side / MANIFEST_NAME) if r["status"] == "ok"][-1:]
        assert record["fingerprint"]["loras"]["files"][0]["sha256"] == new_sha
    # Fingerprints whose LoRAs differ are refused unless the LoRA is the declared variable.
    fp_a = {"dtype": "float32", "loras": {"mode": "fused", "files": [{"sha256": "a" * 64, "strength": 1.0}]}}
    fp_b = {"dtype": "float32", "loras": {"mode": "fused", "files": [{"sha256": "b" * 64, "strength": 1.0}]}}
    assert list(undeclared_differences(fp_a, fp_b, ["lora_mode"])) == ["loras.files"]
    assert undeclared_differences(fp_a, fp_b, ["lora"]) == {}
    assert list(undeclared_differences(fp_a, {"dtype": "float32"}, ["attention_backend"])) == [
        "loras.files",
        "loras.mode",
    ]
    assert json.dumps(again.report)  # JSON-ready
