"""LoRA application on tiny WanDiTs against diffusers + PEFT on the same weights (CPU, fp32).

Each format, fused and unfused, with and without stacked q/k/v projections, equals diffusers'
WanTransformer3DModel with the LoRA loaded by diffusers (its own format conversion, PEFT layers);
removing restores every base tensor bit for bit; two LoRAs are the sum of their deltas; two
experts take different LoRAs as diffusers' load_into_transformer_2 does; bad LoRAs are one-line
errors that leave the weights untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from lora_cases import diffusers_lora, musubi_lora, save, wan_lora

from mmgen.attention import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.lora import LoRARequest, apply_loras, parse_lora
from mmgen.lora.readers import LoRAFile
from mmgen.models.wan import WanConfig, WanDiT

TINY = WanConfig(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
    freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip
# Fused (W + s B A) x vs unfused W x + s B (A x) vs diffusers/PEFT: the same math through differently
# shaped GEMMs, fp32 rounding of a few ulps on the tiny DiT's O(1) outputs (< 1e-6 measured); a LoRA
# moves them by > 1e-2.
TOLERANCE = 1e-5
BUILDERS = {"wan": wan_lora, "musubi": musubi_lora, "diffusers": diffusers_lora}


def make_pair(seed: int) -> tuple[WanDiT, WanTransformer3DModel]:
    torch.manual_seed(seed)
    reference = WanTransformer3DModel(**TINY.to_diffusers_config()).eval()
    ours = WanDiT(TINY).eval()
    ours.load_state_dict(reference.state_dict())
    return ours, reference


@pytest.fixture
def pair():
    return make_pair(0)


def inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, 3, 4, 6, generator=gen),
        torch.tensor([700.0]),
        torch.randn(1, 16, 32, generator=gen),
    )


def run_ours(model, x):
    with torch.no_grad():
        return model(*x, attention=SDPAImpl())


def run_reference(model, x):
    with torch.no_grad():
        return model(*x, return_dict=False)[0]


def lora_file(state, metadata=None, name="x.safetensors") -> LoRAFile:
    return LoRAFile(Path(name), name.ljust(64, "0"), parse_lora(state, metadata, source=name))


def load_reference(reference, state, metadata, name, strength):
    """diffusers' own path: its format conversion, then PEFT layers with the adapter's strength."""
    converted = WanPipeline.lora_state_dict(copied(state))
    meta = None if metadata is None else json.loads(metadata["lora_adapter_metadata"])
    reference.load_lora_adapter(converted, prefix="transformer", adapter_name=name, metadata=meta)
    return name


def copied(state):
    # diffusers' Wan conversion scales the cross-attention/FFN tensors in place (`*=`): give it copies.
    return {k: v.clone() for k, v in state.items()}


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(model, saved):
    state = model.state_dict()
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["plain", "stacked-qkv"])
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_matches_diffusers_peft_and_restores_bitwise(pair, fmt, mode, fused_qkv):
    ours, reference = pair
    if fused_qkv:
        ours.fuse_projections()
    base = snapshot(ours)
    x = inputs()
    before = run_ours(ours, x)
    state, metadata = BUILDERS[fmt](ours)
    applied = apply_loras(
        [ours], [(LoRARequest(Path("x.safetensors"), 0.7), lora_file(state, metadata))], mode=mode
    )
    got = run_ours(ours, x)
    reference.set_adapters([load_reference(reference, state, metadata, "a", 0.7)], weights=[0.7])
    expected = run_reference(reference, x)
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert (got - before).abs().max().item() > 1e-2  # the LoRA did change the output
    (report,) = applied.report.files
    assert report.per_expert[0].matched == report.keys - len(report.ignored)
    assert report.per_expert[0].not_matched == ()
    applied.remove()
    assert_bitwise(ours, base)
    if fused_qkv:  # the stacked matrices are views of the restored weights again
        attn = ours.blocks[0].attn1
        assert torch.equal(
            attn.fused_weight, torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
        )
        assert attn.to_q.weight.data_ptr() == attn.fused_weight.data_ptr()
    assert torch.equal(run_ours(ours, x), before)


def test_fused_equals_unfused_with_two_loras_and_strengths(pair):
    ours, _ = pair
    x = inputs(3)
    a = lora_file(*wan_lora(ours, seed=1), name="a.safetensors")
    b = lora_file(*diffusers_lora(ours, seed=2), name="b.safetensors")
    loras = [(LoRARequest(Path("a.safetensors"), 0.6), a), (LoRARequest(Path("b.safetensors"), -1.3), b)]
    outputs = {}
    for mode in ("fused", "unfused"):
        applied = apply_loras([ours], loras, mode=mode)
        outputs[mode] = run_ours(ours, x)
        applied.remove()
    assert (outputs["fused"] - outputs["unfused"]).abs().max().item() <= TOLERANCE


def test_two_loras_are_the_sum_of_their_deltas(pair):
    ours, _ = pair
    base = snapshot(ours)
    files = [lora_file(*wan_lora(ours, seed=s), name=f"{s}.safetensors") for s in (1, 2)]
    strengths = (0.5, 2.0)
    deltas = []
    for strength, f in zip(strengths, files, strict=True):
        applied = apply_loras([ours], [(LoRARequest(f.path, strength), f)])
        deltas.append({k: v - base[k] for k, v in ours.state_dict().items()})
        applied.remove()
    both = apply_loras([ours], [(LoRARequest(f.path, s), f) for s, f in zip(strengths, files, strict=True)])
    changed = 0
    for key, value in ours.state_dict().items():
        expected = base[key] + deltas[0][key] + deltas[1][key]
        assert (value - expected).abs().max().item() <= 1e-5, key
        changed += int(not torch.equal(value, base[key]))
    assert changed == 2 * 10 + 2 * 2  # every Linear of both blocks, plus q and ffn.0 biases (diff_b)
    both.remove()
    assert_bitwise(ours, base)


def test_diff_weight_delta_is_added_at_strength(pair):
    ours, _ = pair
    base = snapshot(ours)
    delta = torch.randn(32, 32)
    f = lora_file({"diffusion_model.blocks.1.cross_attn.o.diff": delta})
    for mode in ("fused", "unfused"):  # a full delta is merged in both modes
        applied = apply_loras([ours], [(LoRARequest(f.path, 0.25), f)], mode=mode)
        got = ours.blocks[1].attn2.to_out[0].weight
        assert (got - (base["blocks.1.attn2.to_out.0.weight"] + 0.25 * delta)).abs().max() <= 1e-6
        applied.remove()
        assert_bitwise(ours, base)


def test_two_experts_match_load_into_transformer_2():
    (high, ref_high), (low, ref_low) = make_pair(0), make_pair(5)
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=None,
        transformer=ref_high, transformer_2=ref_low, boundary_ratio=0.875,
    )  # fmt: skip
    state_a, _ = wan_lora(high, seed=1)
    state_b, meta_b = diffusers_lora(low, seed=2, alpha=None)
    # low_cpu_mem_usage=False: with it, the lora_B biases a diff_b file leaves out stay on the meta device.
    pipe.load_lora_weights(copied(state_a), adapter_name="a", low_cpu_mem_usage=False)  # expert 0 only
    pipe.load_lora_weights(
        dict(state_b), adapter_name="b", load_into_transformer_2=True, low_cpu_mem_usage=False
    )
    a, b = lora_file(state_a, name="a.safetensors"), lora_file(state_b, meta_b, name="b.safetensors")
    applied = apply_loras(
        [high, low],
        [(LoRARequest(a.path, 1.0, (0,)), a), (LoRARequest(b.path, 1.0, (1,)), b)],
        mode="unfused",
    )
    x = inputs(4)
    assert (run_ours(high, x) - run_reference(ref_high, x)).abs().max().item() <= TOLERANCE
    assert (run_ours(low, x) - run_reference(ref_low, x)).abs().max().item() <= TOLERANCE
    assert [f.experts for f in applied.report.files] == [(0,), (1,)]
    identity = applied.report.identity()
    assert identity["mode"] == "unfused" and [f["experts"] for f in identity["files"]] == [[0], [1]]
    applied.remove()


def test_multi_expert_model_needs_the_experts_named():
    (high, _), (low, _) = make_pair(0), make_pair(5)
    f = lora_file(*wan_lora(high))
    with pytest.raises(ValidationError, match="say which"):
        apply_loras([high, low], [(LoRARequest(f.path, 1.0), f)])
    with pytest.raises(ValidationError, match="expert 2 requested"):
        apply_loras([high, low], [(LoRARequest(f.path, 1.0, (2,)), f)])
    both = apply_loras([high, low], [(LoRARequest(f.path, 1.0, (0, 1)), f)])
    assert [e.expert for e in both.report.files[0].per_expert] == [0, 1]
    both.remove()


def _refused(model, state, message, **kwargs):
    base = snapshot(model)
    f = lora_file(state, name="bad.safetensors")
    with pytest.raises(ValidationError, match=message) as info:
        apply_loras([model], [(LoRARequest(f.path, 1.0), f)], **kwargs)
    text = str(info.value)
    assert "\n" not in text and "bad.safetensors" in text
    assert_bitwise(model, base)  # refused before anything was touched
    return text


def test_unmatched_keys_refused_unless_allowed(pair):
    ours, _ = pair
    state, _ = wan_lora(ours, extras=False)
    state["diffusion_model.blocks.7.self_attn.q.lora_down.weight"] = torch.randn(4, 32)
    state["diffusion_model.blocks.7.self_attn.q.lora_up.weight"] = torch.randn(32, 4)
    state["diffusion_model.unheard_of.lora_down.weight"] = torch.randn(4, 32)
    text = _refused(ours, state, "3 of 63 keys match no weight of expert 0")
    assert "blocks.7.self_attn.q" in text and "--lora-allow-unmatched" in text
    f = lora_file(state, name="bad.safetensors")
    applied = apply_loras([ours], [(LoRARequest(f.path, 1.0), f)], allow_unmatched=True)
    (expert,) = applied.report.files[0].per_expert
    assert expert.matched == 60 and len(expert.not_matched) == 3 and applied.report.allow_unmatched
    applied.remove()


def test_wrong_width_and_i2v_on_t2v_are_one_line_errors(pair):
    ours, _ = pair
    wide = WanDiT(WanConfig(**{**TINY.__dict__, "num_attention_heads": 3}))
    text = _refused(ours, wan_lora(wide, extras=False)[0], "different model size")
    assert "blocks.0.self_attn.q.lora_down.weight" in text
    i2v = {
        "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": torch.randn(2, 32),
        "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": torch.randn(32, 2),
    }
    _refused(ours, i2v, "I2V LoRA cannot go on a T2V model", allow_unmatched=True)


def test_i2v_lora_applies_to_image_projections_by_diffusers_names(pair):
    # The I2V layers are diffusers' attn2.add_k_proj / add_v_proj: a model that has them takes the keys.
    ours, _ = pair
    ours.blocks[0].attn2.add_k_proj = torch.nn.Linear(32, 32)
    base = ours.blocks[0].attn2.add_k_proj.weight.detach().clone()
    down, up = torch.randn(2, 32), torch.randn(32, 2)
    f = lora_file(
        {
            "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": down,
            "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": up,
        }
    )
    applied = apply_loras([ours], [(LoRARequest(f.path, 1.0), f)])
    assert torch.allclose(ours.blocks[0].attn2.add_k_proj.weight, base + up @ down, atol=1e-6)
    applied.remove()
    assert torch.equal(ours.blocks[0].attn2.add_k_proj.weight, base)


def test_saved_file_round_trip(pair, tmp_path):
    from mmgen.lora import LoRASlot

    ours, _ = pair
    base = snapshot(ours)
    path = save(tmp_path / "w.safetensors", *wan_lora(ours))
    slot = LoRASlot()
    report = slot.use([ours], [LoRARequest(path, 0.5)])
    assert report.files[0].sha256 == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert (
        report.files[0].format == "wan" and report.files[0].ranks == (4,) and report.files[0].alphas == (8.0,)
    )
    assert slot.use([ours], [LoRARequest(path, 0.5)]) is report  # unchanged request: kept, not re-applied
    slot.use([ours], [LoRARequest(path, 0.25)], mode="unfused")
    slot.use([ours], [])
    assert_bitwise(ours, base)


def test_distillation_extras_land_on_their_parameters(pair):
    # lightx2v files carry full deltas beyond the block Linears: head, modulation tables, time projection.
    ours, _ = pair
    base = snapshot(ours)
    gen = torch.Generator().manual_seed(3)
    deltas = {
        "head.head.diff": ("proj_out.weight", (16, 32)),
        "head.head.diff_b": ("proj_out.bias", (16,)),
        "blocks.0.modulation.diff": ("blocks.0.scale_shift_table", (1, 6, 32)),
        "time_projection.1.diff_b": ("condition_embedder.time_proj.bias", (192,)),
        "patch_embedding.diff": ("patch_embedding.weight", (32, 4, 1, 2, 2)),
        "blocks.1.norm3.diff": ("blocks.1.norm2.weight", (32,)),  # a norm delta that is not zero is applied
    }
    state = {
        f"diffusion_model.{key}": torch.randn(shape, generator=gen) for key, (_, shape) in deltas.items()
    }
    f = lora_file(state)
    assert f.contents.unknown == () and f.contents.ignored == ()
    for mode in ("fused", "unfused"):
        applied = apply_loras([ours], [(LoRARequest(f.path, 0.5), f)], mode=mode)
        params = dict(ours.named_parameters())
        for key, (name, _) in deltas.items():
            expected = base[name] + 0.5 * state[f"diffusion_model.{key}"]
            assert (params[name] - expected).abs().max().item() <= 1e-6, key
        assert applied.report.files[0].per_expert[0].matched == len(deltas)
        applied.remove()
        assert_bitwise(ours, base)
