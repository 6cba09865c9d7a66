"""QwenImagePipeline against diffusers' QwenImagePipeline on one tiny random model directory (CPU, fp32).

Both load the same diffusers-format directory (tests/qwen_image_cases.py: tiny transformer, VAE,
Qwen2.5-VL and Qwen2 tokenizer). The same seed must give the same image: final latents within 1e-5,
uint8 images identical. diffusers runs true CFG as two transformer calls per step (cond, uncond);
mmgen as one packed call whose rows have their own text lengths (varlen joint attention).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen_image_cases import check_offload_placement
from qwen_image_cases import write_comfy_lora as _write_lora

from mmgen.errors import ValidationError
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from pipelines.qwen_image import QwenImagePipeline
from pipelines.qwen_image_family import draw_noise, pack_latents, unpack_latents

STEPS = 3
SHIFT_KEYS = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
TOL = 1e-5


@pytest.fixture(scope="module")
def ours(qwen_image_dir):
    return QwenImagePipeline.from_pretrained(qwen_image_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(qwen_image_dir, ours):
    import diffusers

    pipe = diffusers.QwenImagePipeline.from_pretrained(str(qwen_image_dir), local_files_only=True)
    pipe.prompt_template_encode_start_idx = ours.components.text_encoder.prefix_tokens  # Qwen's: 34
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers(reference, prompt, negative_prompt, *, seeds, height, width, guidance):
    """diffusers' images (uint8 [B, H, W, 3]) and final latents [B, C, 1, H/8, W/8] for `seeds`."""
    final = {}

    def keep_latents(pipe, step, timestep, values):
        final["latents"] = values["latents"]
        return values

    with torch.no_grad():
        images = reference(
            prompt,
            negative_prompt=negative_prompt,
            true_cfg_scale=guidance,
            height=height,
            width=width,
            num_inference_steps=STEPS,
            generator=[torch.Generator().manual_seed(seed) for seed in seeds],
            callback_on_step_end=keep_latents,
            output_type="pil",
        ).images
    latents = reference._unpack_latents(final["latents"], height, width, reference.vae_scale_factor)
    return np.stack([np.asarray(image) for image in images]), latents


def _check(result, image, latents):
    diff = (result.latents - latents).abs().max().item()
    assert diff <= TOL, diff
    assert result.frames.shape == (1, *image.shape)
    assert np.array_equal(result.image, image), np.abs(result.image.astype(int) - image).max()


def test_one_prompt_without_cfg(ours, reference):
    """No negative prompt: CFG off at any guidance (as diffusers), one prompt, batch 1."""
    image, latents = _diffusers(reference, "a red cat", None, seeds=[7], height=64, width=64, guidance=4.0)
    result = ours("a red cat", seed=7, height=64, width=64, num_inference_steps=STEPS, progress=False)
    assert result.args["guided"] is False
    _check(result, image[0], latents)
    assert result.frames_sha256 == frames_sha256(result.frames)
    assert result.latents_sha256 == tensor_sha256(result.latents)
    assert (
        result.args["seed"] == 7 and result.args["guidance_scale"] == 4.0 and result.args["num_frames"] == 1
    )
    assert set(result.timings) == {"text_encode", "denoise", "decode", "total"}
    assert (
        result.attention_providers == {"transformer.joint_attn": "sdpa:torch"} or result.attention_providers
    )


@pytest.mark.parametrize(("cfg", "calls"), [("batch", [2]), ("sequential", [1, 1])])
def test_negative_prompt_true_cfg_non_square(ours, reference, cfg, calls):
    """True CFG with a negative prompt of another token length, 48 x 80: cfg 'batch' is one packed
    call per step (varlen rows), 'sequential' two calls of batch 1 (as diffusers)."""
    prompt, negative = "a red cat sits on a green mat, photo", "blurry"
    image, latents = _diffusers(reference, prompt, negative, seeds=[11], height=48, width=80, guidance=3.5)
    seen = []
    hook = ours.transformer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        result = ours(
            prompt,
            negative,
            seed=11,
            height=48,
            width=80,
            guidance_scale=3.5,
            num_inference_steps=STEPS,
            cfg=cfg,
            progress=False,
        )
    finally:
        hook.remove()
    assert seen == calls * STEPS
    assert result.args["guided"] is True and result.args["memory_plan"]["cfg"] == cfg
    assert result.frames.shape == (1, 48, 80, 3)
    _check(result, image[0], latents)


def test_cfg_off_at_scale_one(ours, reference):
    image, latents = _diffusers(reference, "sky", "dark", seeds=[3], height=32, width=32, guidance=1.0)
    result = ours(
        "sky",
        "dark",
        seed=3,
        height=32,
        width=32,
        guidance_scale=1.0,
        num_inference_steps=STEPS,
        progress=False,
    )
    assert result.args["guided"] is False
    _check(result, image[0], latents)


def test_batch_of_two_prompts_prompt_by_prompt(ours, reference):
    """diffusers' batch of two prompts of different token lengths (padded + masked, one generator each)
    == mmgen's two requests, each with its generator's seed."""
    prompts, negatives = ["a cat", "a red cat sits on a green mat at noon"], ["dark", "blurry, low quality"]
    images, latents = _diffusers(
        reference, prompts, negatives, seeds=[5, 6], height=32, width=48, guidance=4.0
    )
    for row, seed in enumerate([5, 6]):
        result = ours(
            prompts[row],
            negatives[row],
            seed=seed,
            height=32,
            width=48,
            num_inference_steps=STEPS,
            progress=False,
        )
        _check(result, images[row], latents[row : row + 1])


def test_noise_sources_agree(ours):
    """seed == a generator of that seed == the recorded latents given back (packed or not)."""
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "progress": False}
    by_seed = ours("sky", seed=9, **common)
    by_generator = ours("sky", generator=torch.Generator().manual_seed(9), **common)
    assert by_generator.frames_sha256 == by_seed.frames_sha256
    assert by_generator.args["noise"] == "generator" and by_generator.args["seed"] is None
    noise = torch.randn((1, 1, 4, 4, 4), generator=torch.Generator().manual_seed(9))
    assert torch.equal(unpack_latents(pack_latents(noise), 4, 4), noise.view(1, 4, 1, 4, 4))
    for given in (pack_latents(noise), noise.view(1, 4, 1, 4, 4)):
        assert ours("sky", latents=given, **common).frames_sha256 == by_seed.frames_sha256
    fresh = ours("sky", **common)
    assert isinstance(fresh.args["seed"], int)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_noise_is_diffusers(ours, reference, dtype):
    """The initial latents of a seed == diffusers' prepare_latents with a CPU generator of that seed,
    drawn in the model dtype as diffusers draws them (its text encoder's), packed the same way."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from pipelines.plan import prepare
    from pipelines.qwen_image_family import schedule_shift
    from pipelines.request import GenerationRequest

    request = GenerationRequest.from_call(prompt="sky", seed=21, height=48, width=80)
    expected = reference.prepare_latents(
        1, 4, 48, 80, dtype, torch.device("cpu"), torch.Generator().manual_seed(21)
    )
    assert torch.equal(draw_noise(torch.Generator().manual_seed(21), 4, 6, 10, dtype), expected)
    if dtype == torch.float32:
        plan = prepare(request, ours)
        assert torch.equal(ours.hooks.initial_latents(ours, plan, None, None), expected)
        mu = schedule_shift(ours, plan.request)
        assert mu == calculate_shift(15, *(reference.scheduler.config[name] for name in SHIFT_KEYS))


def test_refusals_one_line_each(ours):
    with pytest.raises(ValidationError) as err:
        ours("sky", num_frames=5, offload="layer", compile=True, fp8_linear=True, progress=False)
    message = str(err.value)
    for name in ("num_frames = 5", "offload = 'layer'", "compile = True", "fp8_linear = True"):
        assert name in message
    assert message.count("; ") == 3
    with pytest.raises(ValidationError, match="either seed or generator"):
        ours("sky", seed=1, generator=torch.Generator(), progress=False)
    with pytest.raises(ValidationError, match="NaN sigma"):
        ours("sky", num_inference_steps=1, progress=False)
    with pytest.raises(ValidationError, match=r"\[2, 1024\]"):  # the request value's bound
        ours("sky", max_sequence_length=2000, progress=False)
    with pytest.raises(ValidationError, match="unknown request field"):
        ours("sky", true_cfg_scale=4.0, progress=False)
    with pytest.raises(ValidationError, match="latents: expected"):
        ours("sky", height=32, width=32, latents=torch.zeros(1, 3, 16), progress=False)


def test_load_pipeline_picks_qwen_image(qwen_image_dir):
    from mmgen.families import load_pipeline

    pipe = load_pipeline(qwen_image_dir, task="t2i", device="cpu", dtype="float32")
    assert isinstance(pipe, QwenImagePipeline) and pipe.dtype == torch.float32
    with pytest.raises(ValidationError, match="text-to-image model") as err:
        load_pipeline(qwen_image_dir, task="t2v", device="cpu", dtype="float32", gpu_memory_gb=20)
    assert "no memory planner" in str(err.value)


def test_cli_generate_writes_the_png(ours, qwen_image_dir, tmp_path, capsys):
    from mmgen.cli import main

    out = tmp_path / "cat.png"
    argv = ["generate", "--model", str(qwen_image_dir), "--out", str(out), "--steps", "2", "--height", "32"]
    argv += ["--width", "48", "--seed", "4", "--device", "cpu", "--dtype", "fp32", "a red cat"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = ours("a red cat", seed=4, height=32, width=48, num_inference_steps=2, progress=False)
    assert f"frames_sha256: {result.frames_sha256}" in printed
    assert out.is_file()


def test_cli_generate_without_out_writes_a_png_for_the_image_model(
    ours, qwen_image_dir, tmp_path, capsys, monkeypatch
):
    """No --out and no --frames: an image model's output is ./mmgen_<seed>.png (a video model's is .mp4)."""
    from mmgen.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["generate", "--model", str(qwen_image_dir), "--steps", "2", "--height", "32", "--width", "48"]
    assert main([*argv, "--seed", "4", "--device", "cpu", "a red cat"]) == 0
    assert "output: mmgen_4.png" in capsys.readouterr().out and (tmp_path / "mmgen_4.png").is_file()


def test_lora_matches_diffusers_and_comes_off(ours, qwen_image_dir, tmp_path):
    """A ComfyUI-layout LoRA at strength 0.8 == diffusers' load_lora_weights + fuse_lora(0.8); the next
    call without it runs the base weights again (same image as before)."""
    import diffusers

    pytest.importorskip("peft")
    path = _write_lora(ours.transformer, tmp_path / "style.safetensors")
    common = {"seed": 2, "height": 32, "width": 48, "num_inference_steps": STEPS, "progress": False}
    base = ours("a red cat", "dark", **common)
    styled = ours("a red cat", "dark", lora=f"{path}:0.8", **common)
    assert styled.frames_sha256 != base.frames_sha256
    assert styled.args["loras"]["files"][0]["strength"] == 0.8 and "loras" in styled.fingerprint
    assert ours("a red cat", "dark", **common).frames_sha256 == base.frames_sha256

    reference = diffusers.QwenImagePipeline.from_pretrained(str(qwen_image_dir), local_files_only=True)
    reference.prompt_template_encode_start_idx = ours.components.text_encoder.prefix_tokens
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(path))
    reference.fuse_lora(lora_scale=0.8)
    image, latents = _diffusers(reference, "a red cat", "dark", seeds=[2], height=32, width=48, guidance=4.0)
    _check(styled, image[0], latents)


def test_render_yaml_job_equals_the_python_call(ours, qwen_image_dir, tmp_path):
    """`mmgen render` over a Qwen-Image directory (task t2i): the job's manifest identity is the call's."""
    import json

    from mmgen.cli import main

    config = tmp_path / "render.yaml"
    config.write_text(
        f"model: {qwen_image_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 32, width: 48, num_frames: 1, num_inference_steps: 2}\n"
        "jobs:\n  - {name: dog, prompt: a dog, negative_prompt: dark, seed: 4}\n"
    )
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    result = ours("a dog", "dark", seed=4, height=32, width=48, num_inference_steps=2, progress=False)
    assert record["status"] == "ok" and record["frames_sha256"] == result.frames_sha256
    assert (tmp_path / "out" / "dog_s4.png").is_file()


@pytest.mark.parametrize("offload", ["model", "layer"])
def test_offload_gives_the_same_image(ours, qwen_image_dir, offload, tmp_path):
    """Weights in host memory, copied in per component (model) or per block (layer): the same bits."""
    from mmgen.families import load_pipeline

    pipe = load_pipeline(qwen_image_dir, task="t2i", device="cpu", dtype="float32", offload=offload)
    common = {"seed": 12, "height": 32, "width": 48, "num_inference_steps": 2, "progress": False}
    result = pipe("a red cat", "dark", **common)
    assert result.frames_sha256 == ours("a red cat", "dark", **common).frames_sha256
    check_offload_placement(pipe, result, offload)
    lora = _write_lora(pipe.transformer, tmp_path / "style.safetensors")
    styled = pipe("a red cat", "dark", lora=f"{lora}:0.8", **common)
    assert styled.frames_sha256 == ours("a red cat", "dark", lora=f"{lora}:0.8", **common).frames_sha256
    assert styled.frames_sha256 != result.frames_sha256
    assert pipe("a red cat", "dark", **common).frames_sha256 == result.frames_sha256  # base weights back
    with pytest.raises(ValidationError, match="only 'fused' LoRAs"):
        pipe("sky", lora=str(lora), lora_mode="unfused", progress=False)


def test_ab_compares_cfg_modes(qwen_image_dir, tmp_path):
    """`mmgen ab` over a Qwen-Image render: cfg batch vs sequential (a run field) is a fair pair."""
    import json

    from mmgen.cli import main

    config = tmp_path / "base.yaml"
    config.write_text(
        f"model: {qwen_image_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 32, width: 48, num_frames: 1, num_inference_steps: 2}\n"
        "jobs:\n  - {name: dog, prompt: a dog, negative_prompt: dark, seed: 4}\n"
    )
    assert main(["ab", str(config), "--set", "cfg=sequential", "--out", str(tmp_path / "ab")]) == 0
    report = json.loads((tmp_path / "ab" / "ab_report.json").read_text())
    assert report["declared"] == ["cfg"] and not report["refused"] and not report["failed_jobs"]
    row = report["jobs"][0]
    assert row["base_memory_plan"]["cfg"] == "batch" and row["candidate_memory_plan"]["cfg"] == "sequential"
    assert row["max_abs"] is not None and row["max_abs"] <= 1


def test_bfloat16_sequential_cfg_is_diffusers_bit_for_bit(qwen_image_dir):
    """In bf16 (transformer, text encoder and VAE, as diffusers' torch_dtype=bfloat16 loads them), a
    seed gives diffusers' image exactly: without CFG, and with true CFG run as two calls (cfg
    'sequential', diffusers' way). The packed call (cfg 'batch') rounds differently in bf16."""
    import diffusers

    ours = QwenImagePipeline.from_pretrained(qwen_image_dir, dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    reference = diffusers.QwenImagePipeline.from_pretrained(
        str(qwen_image_dir), local_files_only=True, torch_dtype=torch.bfloat16
    )
    reference.prompt_template_encode_start_idx = ours.components.text_encoder.prefix_tokens
    reference.set_progress_bar_config(disable=True)
    for negative in (None, "dark"):
        image, latents = _diffusers(
            reference, "a red cat sits", negative, seeds=[3], height=48, width=80, guidance=4.0
        )
        result = ours(
            "a red cat sits",
            negative,
            seed=3,
            height=48,
            width=80,
            num_inference_steps=STEPS,
            cfg="sequential",
            progress=False,
        )
        assert torch.equal(result.latents, latents.float()) and np.array_equal(result.image, image[0])
