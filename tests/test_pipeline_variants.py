"""Every Wan variant through the one pipeline vs diffusers' WanPipeline / WanImageToVideoPipeline (CPU, fp32).

Wan2.1 I2V (CLIP image path + concat), Wan2.2 T2V-A14B and I2V-A14B (two experts switched at a
boundary that falls between two steps), Wan2.2 TI2V-5B (Wan2.2-style VAE, per-token timesteps),
all from the same tiny components (text encoder, tokenizer, scheduler of the embedded default
model; random transformers, CLIP tower and VAE built here) and the same noise.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmgen.default_model import DEFAULTS, TEXT_DIM, VAE, Z_DIM
from mmgen.errors import ValidationError
from mmgen.models.clip_vision import ClipVisionConfig, ClipVisionEncoder
from mmgen.models.wan import WanConfig, WanDiT
from pipelines.wan_t2v import WanT2VPipeline

PROMPT = "a red fox running through a snowy forest at sunset"
NEGATIVE = "blurry dark"
# Max abs difference of final latents from diffusers: the same math in other op orders and GEMM
# shapes (batched CFG vs cond then uncond), fp32 rounding; the pipeline parity tests' 1e-4.
TOLERANCE = 1e-4
# The shared VAE is the default model's: a DiT's input is its noise latents (Z_DIM channels); an I2V DiT
# also takes the image's latents and a first-frame mask with one channel per frame the VAE packs per latent.
I2V_IN = 2 * Z_DIM + VAE["scale_factor_temporal"]
DIT = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    text_dim=TEXT_DIM,  # the embedded default model's text encoder width (shared components)
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
)
CLIP = dict(
    hidden_size=24,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=224,
    patch_size=56,
)
WAN22_VAE = dict(
    base_dim=8,
    z_dim=8,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=8,
    scale_factor_temporal=2,
    latents_mean=[0.1 * i for i in range(8)],
    latents_std=[1.0 + 0.1 * i for i in range(8)],
)


@pytest.fixture(autouse=True)
def _no_ftfy_in_i2v_reference(monkeypatch):
    # diffusers' WanImageToVideoPipeline calls ftfy unconditionally (WanPipeline only when installed);
    # without ftfy installed, give it the identity WanPipeline falls back to.
    import types

    from diffusers.pipelines.wan import pipeline_wan_i2v

    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=str), raising=False)


def _jittered(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return module.eval()


def _transformer(seed: int, **config):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    reference = _jittered(WanTransformer3DModel(**DIT, **config), seed)
    ours = WanDiT(WanConfig.from_diffusers_config(dict(reference.config))).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.fixture(scope="module")
def shared(default_model_dir):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import AutoTokenizer, UMT5EncoderModel

    ours = WanT2VPipeline.from_pretrained(default_model_dir).components
    return {
        "tokenizer": AutoTokenizer.from_pretrained(default_model_dir / "tokenizer"),
        "text_encoder": UMT5EncoderModel.from_pretrained(default_model_dir / "text_encoder").eval(),
        "vae": AutoencoderKLWan.from_pretrained(default_model_dir / "vae").eval(),
        "scheduler": UniPCMultistepScheduler.from_pretrained(default_model_dir / "scheduler"),
        "ours": ours,
    }


def _pair(shared, experts, *, boundary_ratio=None, clip=False, vae=None, expand_timesteps=False):
    """(mmgen pipeline, diffusers WanPipeline, diffusers WanImageToVideoPipeline) from the same parts."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    vae = shared["vae"] if vae is None else vae
    references = [pair[0] for pair in experts]
    image_encoder = processor = ours_clip = None
    if clip:
        torch.manual_seed(5)
        image_encoder = _jittered(CLIPVisionModel(CLIPVisionConfig(**CLIP, hidden_act="gelu")), 5)
        processor = CLIPImageProcessor()
        ours_clip = ClipVisionEncoder(ClipVisionConfig(**CLIP, hidden_act="gelu")).eval()
        ours_clip.load_state_dict(image_encoder.state_dict(), strict=True)
    c = shared["ours"]
    ours = WanT2VPipeline(
        experts[0][1],
        c.text_encoder,
        c.tokenizer,
        vae,
        shared["scheduler"],
        defaults=c.defaults,
        transformer_2=experts[1][1] if len(experts) == 2 else None,
        image_encoder=ours_clip,
        boundary_ratio=boundary_ratio,
        expand_timesteps=expand_timesteps,
    )
    common = dict(
        tokenizer=shared["tokenizer"],
        text_encoder=shared["text_encoder"],
        vae=vae,
        scheduler=copy.deepcopy(shared["scheduler"]),
        transformer=references[0],
        transformer_2=references[1] if len(references) == 2 else None,
        boundary_ratio=boundary_ratio,
        expand_timesteps=expand_timesteps,
    )
    t2v = WanPipeline(**common)
    i2v = WanImageToVideoPipeline(**common, image_encoder=image_encoder, image_processor=processor)
    for pipe in (t2v, i2v):
        pipe.set_progress_bar_config(disable=True)
    return ours, t2v, i2v


def _image(tmp_path, width=50, height=37, seed=0):
    rng = np.random.default_rng(seed)
    # smooth gradients plus noise: a picture whose resize is non-trivial
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    path = tmp_path / "input.png"
    Image.fromarray(pixels).save(path)
    return path, Image.fromarray(pixels)


def _noise(pipe, height, width, frames, seed=7):
    return torch.randn(
        pipe.latents_shape(height, width, frames), generator=torch.Generator().manual_seed(seed)
    )


def _compare(ours, reference, noise, kwargs, *, image_path=None, image=None, guidance_scale_2=None):
    extra = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
    result = ours(PROMPT, NEGATIVE, latents=noise, image=image_path, progress=False, **kwargs, **extra)
    ref_kwargs = {**kwargs, **extra} | ({} if image is None else {"image": image})
    expected = reference(
        prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), output_type="latent", **ref_kwargs
    ).frames
    assert result.latents.shape == expected.shape
    diff = (result.latents - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff of final latents {diff:.3g}"
    assert expected.abs().max() > 0.5
    # same final latents through both decoders: identical uint8 frames
    frames = ours.decode(expected)
    reference_frames = reference(
        prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), output_type="pil", **ref_kwargs
    ).frames[0]
    np.testing.assert_array_equal(frames, np.stack([np.asarray(f) for f in reference_frames]))
    return result


def _expert_trace(ours, reference):
    """Record, per model call, which expert ran (0 / 1), for mmgen and diffusers."""
    trace = {"ours": [], "reference": []}
    for index, model in enumerate(ours.experts):
        model.register_forward_hook(lambda *_, i=index: trace["ours"].append(i))
    for index, model in enumerate((reference.transformer, reference.transformer_2)):
        model.register_forward_hook(lambda *_, i=index: trace["reference"].append(i))
    return trace


def _boundary_between(shared, steps, after):
    """A boundary_ratio falling strictly between scheduler timesteps `after` and `after + 1`."""
    scheduler = copy.deepcopy(shared["scheduler"])
    scheduler.set_timesteps(steps)
    t = scheduler.timesteps.float()
    return float((t[after] + t[after + 1]) / 2) / scheduler.config.num_train_timesteps


def test_wan21_i2v_matches_diffusers(shared, tmp_path):
    experts = [_transformer(1, in_channels=I2V_IN, out_channels=Z_DIM, image_dim=24, added_kv_proj_dim=32)]
    ours, _, reference = _pair(shared, experts, clip=True)
    assert ours.variant.task == "i2v" and ours.variant.image_embeddings
    path, image = _image(tmp_path)  # 50x37: non-square, resized (not cropped) to 32x48
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=5.0)
    result = _compare(ours, reference, _noise(ours, 32, 48, 5), kwargs, image_path=path, image=image)
    assert result.args["image_sha256"] and result.args["image_size"] == [50, 37]
    assert result.args["variant"] == "i2v" and result.args["size_rule"] is None


def test_wan22_t2v_a14b_switches_experts_at_diffusers_step(shared):
    experts = [
        _transformer(2, in_channels=Z_DIM, out_channels=Z_DIM),
        _transformer(3, in_channels=Z_DIM, out_channels=Z_DIM),
    ]
    ratio = _boundary_between(shared, 4, after=1)
    ours, reference, _ = _pair(shared, experts, boundary_ratio=ratio)
    trace = _expert_trace(ours, reference)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=4, guidance_scale=5.0)
    noise = _noise(ours, 32, 48, 5)
    result = ours(PROMPT, NEGATIVE, latents=noise, progress=False, guidance_scale_2=2.5, **kwargs)
    expected = reference(
        PROMPT, NEGATIVE, latents=noise.clone(), output_type="latent", guidance_scale_2=2.5, **kwargs
    ).frames
    assert (result.latents - expected).abs().max().item() <= TOLERANCE
    # ours: one batch-2 call per step; diffusers: cond then uncond (two calls per step)
    assert trace["ours"] == [0, 0, 1, 1]
    assert trace["reference"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert result.args["guidance_scale_2"] == 2.5
    # the second expert and its guidance matter
    other = ours(PROMPT, NEGATIVE, latents=noise, progress=False, guidance_scale_2=5.0, **kwargs)
    assert (other.latents - result.latents).abs().max().item() > 1e-3


def test_wan22_i2v_a14b_matches_diffusers(shared, tmp_path):
    experts = [
        _transformer(4, in_channels=I2V_IN, out_channels=Z_DIM),
        _transformer(5, in_channels=I2V_IN, out_channels=Z_DIM),
    ]
    ratio = _boundary_between(shared, 3, after=0)
    ours, _, reference = _pair(shared, experts, boundary_ratio=ratio)
    assert ours.variant.task == "i2v" and not ours.variant.image_embeddings
    path, image = _image(tmp_path, width=30, height=61)  # portrait
    kwargs = dict(height=48, width=32, num_frames=5, num_inference_steps=3, guidance_scale=4.0)
    _compare(
        ours, reference, _noise(ours, 48, 32, 5), kwargs, image_path=path, image=image, guidance_scale_2=3.0
    )


@pytest.fixture(scope="module")
def ti2v(shared):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(9)
    vae = _jittered(AutoencoderKLWan(**copy.deepcopy(WAN22_VAE)), 9)
    experts = [_transformer(6, in_channels=WAN22_VAE["z_dim"], out_channels=WAN22_VAE["z_dim"])]
    return _pair(shared, experts, vae=vae, expand_timesteps=True)


def test_wan22_ti2v_with_image_matches_diffusers(ti2v, tmp_path):
    ours, _, reference = ti2v
    assert ours.variant.task == "ti2v" and ours.spatial_multiple == 16
    path, image = _image(tmp_path, width=41, height=29)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=5.0)
    _compare(ours, reference, _noise(ours, 32, 48, 5), kwargs, image_path=path, image=image)


def test_wan22_ti2v_text_only_matches_diffusers(ti2v):
    ours, reference, _ = ti2v
    kwargs = dict(height=48, width=32, num_frames=5, num_inference_steps=3, guidance_scale=5.0)
    _compare(ours, reference, _noise(ours, 48, 32, 5), kwargs)


def test_size_from_image_is_reported(ti2v, tmp_path):
    ours, _, _ = ti2v
    path, _ = _image(tmp_path, width=40, height=20)
    result = ours(PROMPT, image=path, num_frames=1, num_inference_steps=1, progress=False)
    area = ours.defaults.height * ours.defaults.width
    assert area == DEFAULTS.height * DEFAULTS.width  # the default model's generation size
    # 2:1 at ~area pixels, each side floored to a multiple of 16 (48*48 -> 34x68 -> 32x64)
    height = round(math.sqrt(area / 2)) // 16 * 16
    width = round(math.sqrt(area * 2)) // 16 * 16
    assert width == 2 * height and height >= 16
    assert result.frames.shape[1:3] == (height, width)
    assert result.args["height"] == height and result.args["width"] == width
    assert f"~{area} pixels" in result.args["size_rule"]


def test_bad_image_input_is_a_one_line_error(shared, ti2v, tmp_path):
    experts = [_transformer(4, in_channels=I2V_IN, out_channels=Z_DIM)]
    i2v, _, _ = _pair(shared, experts)
    cases = [
        (i2v, {}, r"image-to-video \(I2V\): pass image="),
        (i2v, {"image": tmp_path / "missing.png"}, "missing.png: file not found"),
        (i2v, {"image": tmp_path / "notes.png"}, "not a readable image"),
        (i2v, {"image": np.zeros((4, 4), np.uint8)}, r"uint8 \[H, W, 3\]"),
        (ti2v[0], {"image": tmp_path / "thin.png"}, "not a valid grid"),
        (shared_t2v(shared), {"image": tmp_path / "thin.png"}, "text-to-video only"),
        (i2v, {"image": tmp_path / "thin.png", "height": 40, "width": 48}, "height = 40"),
    ]
    (tmp_path / "notes.png").write_text("not a picture")
    Image.fromarray(np.zeros((2, 400, 3), np.uint8)).save(tmp_path / "thin.png")
    for pipe, kwargs, message in cases:
        with pytest.raises(ValidationError, match=message) as info:
            pipe(PROMPT, num_frames=1, num_inference_steps=1, progress=False, **kwargs)
        assert "\n" not in str(info.value)


def shared_t2v(shared):
    c = shared["ours"]
    return WanT2VPipeline(c.transformer, c.text_encoder, c.tokenizer, c.vae, c.scheduler, defaults=c.defaults)


def test_diffusers_directories_of_each_variant_load(shared, ti2v, tmp_path):
    """save_pretrained of diffusers' pipelines -> WanT2VPipeline.from_pretrained -> the same variant and numbers."""
    experts = [_transformer(1, in_channels=I2V_IN, out_channels=Z_DIM, image_dim=24, added_kv_proj_dim=32)]
    _, _, wan21_i2v = _pair(shared, experts, clip=True)
    experts = [
        _transformer(2, in_channels=Z_DIM, out_channels=Z_DIM),
        _transformer(3, in_channels=Z_DIM, out_channels=Z_DIM),
    ]
    _, a14b, _ = _pair(shared, experts, boundary_ratio=0.6)
    cases = [(wan21_i2v, "i2v", 1), (a14b, "t2v", 2), (ti2v[2], "ti2v", 1)]
    path, image = _image(tmp_path)
    for index, (reference, task, experts_count) in enumerate(cases):
        directory = tmp_path / f"model{index}"
        reference.save_pretrained(directory)
        loaded = WanT2VPipeline.from_pretrained(directory)
        assert (loaded.variant.task, loaded.variant.experts) == (task, experts_count)
        kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0)
        noise = _noise(loaded, 32, 48, 5)
        extra = {} if task == "t2v" else {"image": image}
        result = loaded(
            PROMPT, NEGATIVE, latents=noise, image=None if task == "t2v" else path, progress=False, **kwargs
        )
        expected = reference(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            latents=noise.clone(),
            output_type="latent",
            **kwargs,
            **extra,
        ).frames
        assert (result.latents - expected).abs().max().item() <= TOLERANCE
        if index == 0:
            i2v_dir = directory
        if index == 1:
            a14b_dir = directory
    import json

    from mmgen.errors import LoadError

    for directory, drop, message in (
        (i2v_dir, "image_processor", "image_encoder and image_processor come together"),
        (a14b_dir, "boundary_ratio", "transformer_2 and boundary_ratio come together"),
    ):
        index_path = directory / "model_index.json"
        index = json.loads(index_path.read_text())
        del index[drop]
        index_path.write_text(json.dumps(index))
        with pytest.raises(LoadError, match=message):
            WanT2VPipeline.from_pretrained(directory)
