"""mmgen's Wan VACE DiT against diffusers' WanVACETransformer3DModel on tiny random configs (CPU, fp32, <= 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file
from wan_cases import DIFFUSERS_TINY_DIT, diffusers_to_original_vace_key

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.errors import LoadError, ValidationError
from mmgen.loading.wan_vace import load_wan_vace_transformer, read_wan_vace_config
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanConfig, WanDiT
from mmgen.models.wan_vace import WanVACEConfig, WanVACEDiT
from mmgen.parallel.launch import run_parallel
from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout

TEXT_LEN = 16
CONTROL_CHANNELS = 6  # stands in for Wan2.1 VACE's 96 (video latents + packed mask)
# 4 main blocks; VACE blocks hint blocks 3 and 0, listed out of order: the first VACE block (the one
# with proj_in) still feeds block 0, as in diffusers.
TINY = {
    **DIFFUSERS_TINY_DIT,
    "num_layers": 4,
    "in_channels": 4,
    "out_channels": 4,
    "vace_layers": [3, 0],
    "vace_in_channels": CONTROL_CHANNELS,
}
# (batch, latent frames, height, width, valid text tokens per prompt); all non-square
SHAPES = [(1, 3, 6, 4, (7,)), (2, 2, 4, 6, (5, 11)), (1, 1, 8, 12, (16,))]


def jittered(model_class, config):
    torch.manual_seed(0)
    model = model_class(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="module")
def reference() -> WanVACETransformer3DModel:
    return jittered(WanVACETransformer3DModel, TINY)


@pytest.fixture(scope="module")
def model(reference) -> WanVACEDiT:
    config = WanVACEConfig.from_diffusers_config(dict(reference.config))
    mine = WanVACEDiT(config).eval()
    mine.load_state_dict(reference.state_dict(), strict=True)
    return mine


def make_inputs(batch, frames, height, width, lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, frames, height, width, generator=gen)
    control = torch.randn(batch, CONTROL_CHANNELS, frames, height, width, generator=gen)
    timestep = torch.tensor([999.0, 321.5][:batch])
    text = torch.randn(batch, TEXT_LEN, 32, generator=gen)
    for row, length in enumerate(lengths):
        text[row, length:] = 0  # Wan's prompts: zero-padded to the fixed text length
    return latents, control, timestep, text


def diffusers_forward(reference, latents, control, timestep, text, scale):
    scales = None if scale is None else torch.tensor(scale, dtype=torch.float32).expand(2).clone()
    with torch.no_grad():
        return reference(
            latents,
            timestep,
            text,
            control_hidden_states=control,
            control_hidden_states_scale=scales,
            return_dict=False,
        )[0]


def test_state_dict_keys_are_diffusers(reference, model):
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    assert model.vace_blocks[0].proj_in is not None and model.vace_blocks[1].proj_in is None


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
@pytest.mark.parametrize("scale", [None, 0.6], ids=["scale1", "scale0.6"])
def test_matches_diffusers(reference, model, shape, scale):
    latents, control, timestep, text = make_inputs(*shape)
    with torch.no_grad():
        out = model(
            latents,
            timestep,
            text,
            attention=SDPAImpl(),
            control=control,
            control_scale=1.0 if scale is None else scale,
        )
    expected = diffusers_forward(reference, latents, control, timestep, text, scale)
    assert out.shape == expected.shape == latents.shape
    assert (out - expected).abs().max().item() <= 1e-5


def test_per_block_scales_match_diffusers(reference, model):
    latents, control, timestep, text = make_inputs(*SHAPES[0])
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=(0.3, -1.5))
        expected = reference(
            latents,
            timestep,
            text,
            control_hidden_states=control,
            control_hidden_states_scale=torch.tensor([0.3, -1.5]),
            return_dict=False,
        )[0]
        one = model(latents, timestep, text, attention=SDPAImpl(), control=control)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (out - one).abs().max().item() > 1e-3  # the scales matter


def test_flash_reference_and_block_chunks_equal_sdpa(model):
    latents, control, timestep, text = make_inputs(*SHAPES[1])
    with torch.no_grad():
        sdpa = model(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.6)
        flash = model(
            latents,
            timestep,
            text,
            attention=FlashAttentionImpl("reference"),
            control=control,
            control_scale=0.6,
        )
        chunked = model(
            latents,
            timestep,
            text,
            attention=SDPAImpl(),
            control=control,
            control_scale=0.6,
            settings=ExecutionSettings(block_chunk=5, ffn_chunk=7),
        )
    assert (flash - sdpa).abs().max().item() <= 1e-5
    assert (chunked - sdpa).abs().max().item() <= 1e-5


def test_fused_and_compiled_blocks_equal_eager(reference):
    latents, control, timestep, text = make_inputs(*SHAPES[1])
    model = WanVACEDiT(WanVACEConfig.from_diffusers_config(dict(reference.config))).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    keys = list(model.state_dict())

    def run() -> torch.Tensor:
        return model(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.6)

    with torch.no_grad():
        eager = run()
        model.fuse_projections()
        fused = run()
        torch._dynamo.reset()
        model.compile_blocks(backend="aot_eager")
        compiled = run()
    torch._dynamo.reset()
    assert all(block.attn1.fused_projections for block in model.vace_blocks)
    assert all(block._compiled_call_impl is not None for block in model.vace_blocks)  # nn.Module.compile's
    assert list(model.state_dict()) == keys
    assert (fused - eager).abs().max().item() <= 1e-6
    assert (compiled - eager).abs().max().item() <= 1e-6


def test_scale_zero_is_the_plain_wan_dit(reference, model):
    """diffusers' VACE model always needs a control input; with every hint scaled by 0 its main stream
    is the plain Wan DiT's: mmgen's WanDiT (and diffusers' WanTransformer3DModel) on the shared weights."""
    shared = {k: v for k, v in reference.state_dict().items() if not k.startswith("vace_")}
    plain_config = {k: v for k, v in TINY.items() if not k.startswith("vace_")}
    plain = WanDiT(WanConfig.from_diffusers_config(plain_config)).eval()
    plain.load_state_dict(shared, strict=True)
    plain_reference = WanTransformer3DModel(**plain_config).eval()
    plain_reference.load_state_dict(shared, strict=True)
    latents, control, timestep, text = make_inputs(*SHAPES[1])
    with torch.no_grad():
        off = model(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.0)
        base = plain(latents, timestep, text, attention=SDPAImpl())
        expected = plain_reference(latents, timestep, text, return_dict=False)[0]
        on = model(latents, timestep, text, attention=SDPAImpl(), control=control)
    assert torch.equal(off, base)
    assert (base - expected).abs().max().item() <= 1e-5
    assert (on - base).abs().max().item() > 1e-3  # the hints matter


def test_text_lens_metadata_per_stream(model):
    """text_lens limits the text keys of both streams (each gets its own metadata, built once)."""
    latents, control, timestep, text = make_inputs(*SHAPES[1])
    lens = torch.tensor([5, 11])
    with torch.no_grad():
        masked = model(latents, timestep, text, attention=SDPAImpl(), control=control, text_lens=lens)
        built = model(
            latents,
            timestep,
            text,
            attention=SDPAImpl(),
            control=control,
            metadata=WanDiT.build_attention_metadata(lens),
            control_metadata=WanDiT.build_attention_metadata(lens),
        )
        dense = model(latents, timestep, text, attention=SDPAImpl(), control=control)
    assert torch.equal(masked, built)
    assert (masked - dense).abs().max().item() > 1e-4


def test_loads_from_diffusers_directory(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    config, layout = read_wan_vace_config(tmp_path)
    assert layout == "diffusers"
    assert config.vace_layers == (3, 0) and config.hint_layers == (0, 3)
    assert config.to_diffusers_config() == {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in reference.config.items()
        if not k.startswith("_")
    }
    loaded = load_wan_vace_transformer(tmp_path, dtype=torch.float32)
    latents, control, timestep, text = make_inputs(*SHAPES[0])
    with torch.no_grad():
        out = loaded(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.6)
    expected = diffusers_forward(reference, latents, control, timestep, text, 0.6)
    assert (out - expected).abs().max().item() <= 1e-5


ORIGINAL_CONFIG = {
    "_class_name": "VaceWanModel",
    "model_type": "vace",
    "dim": 32,
    "ffn_dim": 64,
    "freq_dim": 32,
    "in_dim": 4,
    "out_dim": 4,
    "num_heads": 2,
    "num_layers": 4,
    "text_dim": 32,
    "text_len": 512,
    "eps": 1e-6,
    "vace_layers": [3, 0],
}


def test_test_vace_key_map_agrees_with_diffusers_converter(reference):
    original = {diffusers_to_original_vace_key(k): v for k, v in reference.state_dict().items()}
    assert "vace_blocks.0.before_proj.weight" in original and "vace_blocks.1.after_proj.bias" in original
    converted = convert_wan_transformer_to_diffusers(dict(original))
    assert sorted(converted) == sorted(reference.state_dict())


@pytest.mark.parametrize("with_in_dim", [True, False], ids=["vace_in_dim", "width-from-weights"])
def test_original_layout_matches_diffusers(reference, tmp_path, with_in_dim):
    state = {diffusers_to_original_vace_key(k): v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    config = {**ORIGINAL_CONFIG, **({"vace_in_dim": CONTROL_CHANNELS} if with_in_dim else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_wan_vace_transformer(tmp_path, dtype=torch.float32)
    assert read_wan_vace_config(tmp_path, vace_in_dim=CONTROL_CHANNELS)[1] == "original"
    latents, control, timestep, text = make_inputs(*SHAPES[1])
    with torch.no_grad():
        out = loaded(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.6)
    expected = diffusers_forward(reference, latents, control, timestep, text, 0.6)
    assert (out - expected).abs().max().item() <= 1e-5


def test_original_config_without_vace_layers_raises(tmp_path):
    config = {k: v for k, v in ORIGINAL_CONFIG.items() if k != "vace_layers"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="lacks vace_layers"):
        read_wan_vace_config(tmp_path, vace_in_dim=CONTROL_CHANNELS)


def test_plain_wan_config_is_refused(tmp_path):
    WanTransformer3DModel(**{k: v for k, v in TINY.items() if not k.startswith("vace_")}).save_pretrained(
        tmp_path
    )
    with pytest.raises(LoadError, match="not a Wan VACE transformer config"):
        read_wan_vace_config(tmp_path)


@pytest.mark.parametrize(
    "vace_layers",
    [[1, 2], [0, 0], [0, 4], []],
    ids=["no-zero", "repeated", "past-end", "empty"],
)
def test_bad_vace_layers_raise(vace_layers):
    with pytest.raises(ValidationError, match="vace_layers"):
        WanVACEConfig(num_layers=4, vace_layers=tuple(vace_layers))


def test_bad_inputs_raise(model):
    latents, control, timestep, text = make_inputs(*SHAPES[0])
    with pytest.raises(ValidationError, match="control must be"):
        model(latents, timestep, text, attention=SDPAImpl(), control=control[:, :, :2])
    with pytest.raises(ValidationError, match="control_scale"):
        model(latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=(1.0, 1.0, 1.0))
    stream = ExecutionSettings(block_stream=lambda blocks: iter(blocks))
    with pytest.raises(ValidationError, match="block stream"):
        model(latents, timestep, text, attention=SDPAImpl(), control=control, settings=stream)


def sequence_parallel_errors(layout: ParallelLayout) -> dict[str, float]:
    """Each rank: the tiny VACE model under Ulysses (this world) and Ring, against parallel=None."""
    torch.manual_seed(0)
    model = WanVACEDiT(WanVACEConfig.from_diffusers_config(TINY)).eval()
    layouts = {"ulysses2": layout, "ring2": init_layout(ParallelConfig(sp=2, ring=2))}
    errors = {}
    for shape in (SHAPES[1], (1, 3, 6, 10, (7,))):  # 2 x 12 tokens; 45 tokens (a padded shard)
        latents, control, timestep, text = make_inputs(*shape)
        with torch.no_grad():
            expected = model(
                latents, timestep, text, attention=SDPAImpl(), control=control, control_scale=0.6
            )
            for name, sharded in layouts.items():
                got = model(
                    latents,
                    timestep,
                    text,
                    attention=SDPAImpl(),
                    control=control,
                    control_scale=0.6,
                    parallel=sharded,
                )
                errors[f"{name}/{'x'.join(map(str, shape[:4]))}"] = (got - expected).abs().max().item()
    return errors


def test_sequence_parallel_equals_one_process():
    """A gloo world of 2 (forked, CPU): the control stream sharded like the main one, within 1e-5."""
    errors = run_parallel(sequence_parallel_errors, ParallelConfig(sp=2), start_method="fork")
    assert len(errors) == 4
    assert all(err <= 1e-5 for err in errors.values()), errors
