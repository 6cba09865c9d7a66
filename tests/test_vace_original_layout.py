"""The original Wan2.1-VACE release layout (as Wan-AI/Wan2.1-VACE-1.3B ships it: config.json
(VaceWanModel, model_type vace, vace_layers, vace_in_dim) and diffusion_pytorch_model.safetensors at
the root, Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/) loads through
mmgen.families.load_pipeline, the loader `mmgen generate` uses, and makes exactly what the same
weights make from a diffusers-layout directory (WanVACEPipeline's). Tiny random weights, CPU, fp32;
the original names are written by the tests' own maps (tests/wan_cases.py)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler
from PIL import Image
from safetensors.torch import save_file
from vace_cases import picture, vace_transformer
from wan_cases import diffusers_to_original_vace_key, t5_original_key, vae_original_key

from mmgen.families import load_pipeline
from mmgen.loading.original_dir import flow_scheduler
from mmgen.loading.umt5 import load_umt5_encoder
from mmgen.models.wan_vace import WanVACEDiT

PROMPT = "a red fox running through a snowy forest at sunset"
HEIGHT, WIDTH, FRAMES = 32, 48, 5  # the VAE below: x4 spatial, x4 temporal -> 2 latent frames
# Wan2.1's VAE (z_dim 16: the only one the original layout holds), tiny.
VAE = dict(
    base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
    scale_factor_spatial=4, scale_factor_temporal=4,
)  # fmt: skip
VACE_SHIFT = 16.0  # Wan2.1 generate.py's sample_shift for VACE: the original layout holds no scheduler


@pytest.fixture(scope="module")
def layouts(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(original, diffusers): the same tiny Wan2.1 VACE weights in both layouts."""
    from diffusers import AutoencoderKLWan

    root = tmp_path_factory.mktemp("vace-layouts")
    text_encoder = load_umt5_encoder(default_model_dir / "text_encoder")
    z, spatial = VAE["z_dim"], VAE["scale_factor_spatial"]
    transformer = vace_transformer(
        5,
        in_channels=z,
        out_channels=z,
        text_dim=text_encoder.config.d_model,
        vace_in_channels=2 * z + spatial**2,
    )
    torch.manual_seed(4)
    vae = AutoencoderKLWan(**VAE).eval()

    original = root / "Wan2.1-VACE-1.3B"
    original.mkdir()
    c = transformer.config
    config = {
        "_class_name": "VaceWanModel", "_diffusers_version": "0.30.0", "model_type": "vace",
        "dim": c.num_attention_heads * c.attention_head_dim, "num_heads": c.num_attention_heads,
        "in_dim": c.in_channels, "out_dim": c.out_channels, "ffn_dim": c.ffn_dim, "freq_dim": c.freq_dim,
        "num_layers": c.num_layers, "eps": c.eps, "text_dim": c.text_dim, "text_len": 512,
        "vace_layers": list(c.vace_layers), "vace_in_dim": c.vace_in_channels,
    }  # fmt: skip
    (original / "config.json").write_text(json.dumps(config))
    state = {diffusers_to_original_vace_key(k): v.contiguous() for k, v in transformer.state_dict().items()}
    assert "vace_blocks.0.before_proj.weight" in state and "vace_patch_embedding.weight" in state
    save_file(state, str(original / "diffusion_pytorch_model.safetensors"))
    vae_state = {vae_original_key(k, VAE["num_res_blocks"]): v for k, v in vae.state_dict().items()}
    torch.save(vae_state, original / "Wan2.1_VAE.pth")
    t5 = {t5_original_key(k): v for k, v in text_encoder.state_dict().items()}
    torch.save(t5, original / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(default_model_dir / "tokenizer", original / "google" / "umt5-xxl")

    diffusers = root / "Wan2.1-VACE-1.3B-diffusers"
    keep = shutil.ignore_patterns("transformer", "vae", "scheduler", "mmgen_defaults.json")
    shutil.copytree(default_model_dir, diffusers, ignore=keep)  # text encoder, tokenizer
    transformer.save_pretrained(diffusers / "transformer")
    vae.save_pretrained(diffusers / "vae")
    UniPCMultistepScheduler(**flow_scheduler(VACE_SHIFT).config.to_diffusers()).save_pretrained(
        diffusers / "scheduler"
    )
    index = json.loads((diffusers / "model_index.json").read_text())
    index.update(_class_name="WanVACEPipeline", transformer=["diffusers", "WanVACETransformer3DModel"])
    (diffusers / "model_index.json").write_text(json.dumps(index))
    return original, diffusers


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A control video (a folder of PNG frames), a mask (white box: regenerate) and a reference image."""
    folder = tmp_path_factory.mktemp("vace-inputs")
    paths = {"video": folder / "video", "mask": folder / "mask", "reference": folder / "reference.png"}
    mask = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    mask[8:24, 8:40] = 255
    for name in ("video", "mask"):
        paths[name].mkdir()
    for index in range(FRAMES):
        Image.fromarray(picture(HEIGHT, WIDTH, 50 + index)).save(paths["video"] / f"{index:03d}.png")
        Image.fromarray(mask).save(paths["mask"] / f"{index:03d}.png")
    Image.fromarray(picture(40, 24, 60)).save(paths["reference"])
    return paths


def generate(model: Path, out: Path, inputs: dict[str, Path]) -> dict[str, str]:
    """`mmgen generate` (in this process) on `model` with the VACE inputs; its name: value lines."""
    from mmgen.cli import main

    args = ["generate", PROMPT, "--model", str(model), "--device", "cpu", "--dtype", "float32"]
    args += ["--video", str(inputs["video"]), "--mask", str(inputs["mask"])]
    args += ["--reference-image", str(inputs["reference"]), "--steps", "2", "--guidance", "4.0"]
    args += ["--seed", "9", "--no-progress", "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(args)
    assert code == 0, printed.getvalue()
    return dict(line.split(": ", 1) for line in printed.getvalue().splitlines() if ": " in line)


def test_original_layout_loads_through_the_pipeline_loader(layouts) -> None:
    original, diffusers = layouts
    pipe = load_pipeline(original, task="t2v", device="cpu", dtype="float32")
    reference = load_pipeline(diffusers, task="t2v", device="cpu", dtype="float32")
    assert isinstance(pipe.transformer, WanVACEDiT) and pipe.variant.task == "vace"
    assert pipe.transformer.config == reference.transformer.config
    assert pipe.components.scheduler.config.flow_shift == VACE_SHIFT
    assert pipe.defaults == reference.defaults  # neither directory has mmgen_defaults.json
    for name, tensor in reference.transformer.state_dict().items():
        assert torch.equal(pipe.transformer.state_dict()[name], tensor), name


def test_original_layout_generates_what_the_diffusers_layout_does(layouts, inputs, tmp_path) -> None:
    original, diffusers = layouts
    ours = generate(original, tmp_path / "original.mp4", inputs)
    expected = generate(diffusers, tmp_path / "diffusers.mp4", inputs)
    for name in ("frames_sha256", "latents_sha256", "video_sha256", "mask_sha256", "reference_images_sha256"):
        assert ours[name] == expected[name], name


def test_what_the_original_wan21_layout_lacks_is_named(layouts, tmp_path) -> None:
    from mmgen.errors import LoadError

    broken = tmp_path / "broken"
    shutil.copytree(layouts[0], broken)
    (broken / "Wan2.1_VAE.pth").unlink()
    with pytest.raises(LoadError, match=r"Wan2\.1_VAE\.pth: file not found \(original Wan2\.1 layout\)"):
        load_pipeline(broken, task="t2v", device="cpu", dtype="float32")
    config = json.loads((layouts[0] / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "i2v"}))
    with pytest.raises(LoadError, match="model_type 'i2v' is not read from the original Wan2.1 layout"):
        load_pipeline(broken, task="t2v", device="cpu", dtype="float32")


def test_original_wan21_t2v_layout_loads_too(layouts, tmp_path) -> None:
    """The same layout without the VACE parts (Wan-AI/Wan2.1-T2V-1.3B's) is a plain Wan2.1 T2V model."""
    from safetensors.torch import load_file

    plain = tmp_path / "Wan2.1-T2V"
    shutil.copytree(layouts[0], plain)
    config = json.loads((plain / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("vace_")}
    (plain / "config.json").write_text(json.dumps({**config, "_class_name": "WanModel", "model_type": "t2v"}))
    weights = plain / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("vace_")}, str(weights))
    pipe = load_pipeline(plain, task="t2v", device="cpu", dtype="float32")
    assert not isinstance(pipe.transformer, WanVACEDiT) and pipe.variant.task == "t2v"
    assert pipe.components.scheduler.config.flow_shift == 5.0  # Wan2.1 generate.py's T2V sample_shift
    result = pipe(
        PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=1, progress=False
    )
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
