"""The Qwen-Image-Lightning presets against the schedule lightx2v publishes, on the CPU.

The independent reference is the model card's recipe, written out here as its authors give it to
diffusers (ModelTC/Qwen-Image-Lightning generate_with_diffusers.py): a FlowMatchEulerDiscreteScheduler
from that config, timesteps set as diffusers' QwenImagePipeline sets them (its sigmas, its
calculate_shift, retrieve_timesteps), true_cfg_scale 1.0, 8 or 4 steps, the LoRA loaded with
load_lora_weights. The LoRA file is a tiny synthetic one in the Lightning releases' layout: bare
diffusers module names with `lora_down.weight` / `lora_up.weight` / `alpha` (what their merge script
reads; a ComfyUI repack adds `diffusion_model.`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.lora import read_lora_file
from mmgen.lora.qwen_image import parse_qwen_image_lora
from pipelines.presets import PRESETS, presets_of
from pipelines.qwen_image import QwenImagePipeline

MODEL_CARD_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": math.log(3),  # "We use shift=3 in distillation"
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": math.log(3),
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
RANK, ALPHA = 4, 2.0


def _diffusers_schedule(steps: int, image_seq_len: int):
    """timesteps and sigmas as diffusers' QwenImagePipeline sets them on the model card's scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(MODEL_CARD_SCHEDULER)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
    return timesteps, scheduler.sigmas, mu


@pytest.mark.parametrize("name", ["lightning-8step", "lightning-4step"])
@pytest.mark.parametrize("image_seq_len", [6, 4096, 6889])  # a tiny test image, 1024^2, 1328^2
def test_lightning_sigmas_are_the_model_cards(name, image_seq_len):
    pytest.importorskip("diffusers")
    from pipelines.qwen_image_family import calculate_shift

    preset = PRESETS[name]
    steps = int(name.split("-")[1].removesuffix("step"))
    assert (preset.family, preset.num_inference_steps, preset.guidance_scale) == ("qwen-image", steps, 1.0)
    timesteps, sigmas, mu = _diffusers_schedule(steps, image_seq_len)
    ours_mu = calculate_shift(
        image_seq_len,
        *(
            preset.scheduler_config[k]
            for k in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
        ),
    )
    assert ours_mu == mu == pytest.approx(math.log(3))  # shift 3 at every size
    scheduler = preset.scheduler("cpu", mu=ours_mu)
    assert torch.equal(scheduler.sigmas, sigmas) and torch.equal(scheduler.timesteps, timesteps)
    expected = [3 * s / (1 + 2 * s) for s in np.linspace(1.0, 1 / steps, steps)] + [0.0]
    assert scheduler.sigmas.tolist() == pytest.approx(expected, abs=1e-6)


def test_presets_are_per_family():
    assert presets_of("qwen-image") == ("lightning-8step", "lightning-4step")
    assert presets_of("wan") == ("distill-4step",)
    assert PRESETS["distill-4step"].to_json()["shift"] == 5.0


@pytest.fixture(scope="module")
def ours(qwen_image_dir):
    return QwenImagePipeline.from_pretrained(qwen_image_dir, dtype=torch.float32)


def lightning_lora(transformer, path, *, prefix: str = ""):
    """Every Linear of the transformer blocks, as the Lightning files name them (module.lora_down.weight,
    module.lora_up.weight, module.alpha; `prefix` 'diffusion_model.' for the ComfyUI repack)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(13)
    state = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
            key = f"{prefix}{name}"
            state[f"{key}.lora_down.weight"] = torch.randn(RANK, module.in_features, generator=generator)
            state[f"{key}.lora_up.weight"] = 0.1 * torch.randn(module.out_features, RANK, generator=generator)
            state[f"{key}.alpha"] = torch.tensor(ALPHA)
    save_file(state, str(path))
    return path, state


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_lightning_lora_layout_reads_every_key(ours, tmp_path, prefix):
    path, state = lightning_lora(ours.transformer, tmp_path / "lightning.safetensors", prefix=prefix)
    contents = read_lora_file(path, parse=parse_qwen_image_lora).contents
    assert not contents.unknown
    modules = {
        key.removeprefix(prefix).rsplit(".", 2)[0] for key in state if key.endswith("lora_down.weight")
    }
    assert {target.weight for target in contents.targets} == {f"{module}.weight" for module in modules}
    assert {target.low_rank.scale for target in contents.targets} == {ALPHA / RANK}
    used = {key for target in contents.targets for key in target.keys}
    assert used == set(state)  # every key read: the pairs and their alphas


@pytest.mark.parametrize("name", ["lightning-8step", "lightning-4step"])
def test_lightning_preset_with_its_lora_is_the_model_cards_diffusers_run(
    ours, qwen_image_dir, tmp_path, name
):
    """`pipe(prompt, preset=..., lora=PATH)` == diffusers with the model card's scheduler, the LoRA
    loaded (and fused) and true_cfg_scale 1.0 with negative prompt " " (their script's): CFG off."""
    import diffusers

    pytest.importorskip("peft")
    path, _ = lightning_lora(ours.transformer, tmp_path / "lightning.safetensors")
    steps = PRESETS[name].num_inference_steps
    seen = []
    hook = ours.transformer.register_forward_pre_hook(lambda module, args: seen.append(float(args[1][0])))
    try:
        result = ours(
            "a red cat", " ", preset=name, lora=str(path), seed=5, height=32, width=48, progress=False
        )
    finally:
        hook.remove()
    assert result.args["preset"] == name and result.args["num_inference_steps"] == steps
    assert result.args["guidance_scale"] == 1.0 and result.args["guided"] is False
    assert result.args["preset_settings"]["scheduler_config"]["base_shift"] == math.log(3)
    assert "loras" in result.args and "loras" in result.fingerprint
    assert len(seen) == steps  # one batch-1 call per step: no CFG

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(MODEL_CARD_SCHEDULER)
    reference = diffusers.QwenImagePipeline.from_pretrained(
        str(qwen_image_dir), scheduler=scheduler, local_files_only=True
    )
    reference.prompt_template_encode_start_idx = ours.components.text_encoder.prefix_tokens
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(path))
    reference.fuse_lora(lora_scale=1.0)
    final = {}

    def keep(pipe, step, timestep, values):
        final["latents"] = values["latents"]
        return values

    with torch.no_grad():
        image = reference(
            "a red cat",
            negative_prompt=" ",
            true_cfg_scale=1.0,
            height=32,
            width=48,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(5),
            callback_on_step_end=keep,
            output_type="pil",
        ).images[0]
    latents = reference._unpack_latents(final["latents"], 32, 48, reference.vae_scale_factor)
    assert (result.latents - latents).abs().max().item() <= 1e-5
    assert np.array_equal(result.image, np.asarray(image))


def test_preset_conflicts_and_cli(ours, qwen_image_dir, tmp_path, capsys):
    from mmgen.cli import main

    with pytest.raises(ValidationError, match="conflicts with preset 'lightning-8step', which sets 8"):
        ours("sky", preset="lightning-8step", num_inference_steps=4, progress=False)
    with pytest.raises(ValidationError, match="conflicts with preset 'lightning-4step', which sets 1.0"):
        ours("sky", preset="lightning-4step", guidance_scale=4.0, progress=False)
    path, _ = lightning_lora(ours.transformer, tmp_path / "lightning.safetensors")
    out = tmp_path / "cat.png"
    argv = ["generate", "--model", str(qwen_image_dir), "--out", str(out), "--preset", "lightning-4step"]
    argv += [
        "--lora",
        str(path),
        "--height",
        "32",
        "--width",
        "48",
        "--seed",
        "5",
        "--device",
        "cpu",
        "a red cat",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = ours(
        "a red cat", preset="lightning-4step", lora=str(path), seed=5, height=32, width=48, progress=False
    )
    assert f"frames_sha256: {result.frames_sha256}" in printed and "preset: lightning-4step" in printed
    assert main([*argv[:6], "distill-4step", *argv[7:]]) == 2
    assert "a Wan preset; this Qwen-Image model takes the presets lightning-8step, lightning-4step" in (
        capsys.readouterr().err
    )


def test_render_job_with_the_preset_equals_the_python_call(ours, qwen_image_dir, tmp_path):
    """A render YAML job naming the preset and its LoRA: the manifest's identity is the call's."""
    import json

    from mmgen.cli import main

    path, _ = lightning_lora(ours.transformer, tmp_path / "lightning.safetensors")
    config = tmp_path / "render.yaml"
    config.write_text(
        f"model: {qwen_image_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 32, width: 48, num_frames: 1, preset: lightning-4step}\n"
        f"jobs:\n  - {{name: cat, prompt: a red cat, seed: 5, loras: [{path}]}}\n"
    )
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    result = ours(
        "a red cat", preset="lightning-4step", lora=str(path), seed=5, height=32, width=48, progress=False
    )
    assert record["status"] == "ok" and record["frames_sha256"] == result.frames_sha256
