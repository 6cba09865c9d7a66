"""LoRA file formats -> the one internal form (pure functions), and the file reader's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lora_cases import diffusers_lora, musubi_lora, save, wan_lora

from mmgen.errors import LoadError, ValidationError
from mmgen.lora import LoRARequest, parse_lora, read_lora_file
from mmgen.lora.names import musubi_module, original_parameter
from mmgen.lora.readers import ZERO_REASON
from mmgen.models.wan import WanConfig, WanDiT

TINY = WanConfig(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
    freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> WanDiT:
    torch.manual_seed(0)
    return WanDiT(TINY).eval()


def by_weight(contents):
    return {t.weight: t for t in contents.targets}


def test_original_names_map_to_diffusers_names():
    assert original_parameter("blocks.3.self_attn.q") == (
        "blocks.3.attn1.to_q.weight",
        "blocks.3.attn1.to_q.bias",
    )
    assert original_parameter("blocks.0.cross_attn.o")[0] == "blocks.0.attn2.to_out.0.weight"
    assert original_parameter("blocks.0.cross_attn.k_img")[0] == "blocks.0.attn2.add_k_proj.weight"
    assert original_parameter("blocks.0.cross_attn.v_img")[0] == "blocks.0.attn2.add_v_proj.weight"
    assert original_parameter("blocks.1.norm3")[0] == "blocks.1.norm2.weight"  # the cross-attention norm
    assert original_parameter("blocks.1.ffn.0")[0] == "blocks.1.ffn.net.0.proj.weight"
    assert original_parameter("blocks.1.modulation") == ("blocks.1.scale_shift_table", None)
    assert original_parameter("head.head")[0] == "proj_out.weight"
    assert original_parameter("time_projection.1")[0] == "condition_embedder.time_proj.weight"
    assert original_parameter("text_embedding.2")[0] == "condition_embedder.text_embedder.linear_2.weight"
    assert original_parameter("blocks.1.self_attn.k_img") is None  # image keys live in cross-attention only
    assert original_parameter("blocks.x.foo") is None and original_parameter("transformer") is None
    assert musubi_module("blocks_12_cross_attn_v_img") == "blocks.12.cross_attn.v_img"
    assert musubi_module("blocks_0_ffn_2") == "blocks.0.ffn.2"
    assert musubi_module("text_embedding_0") == "text_embedding.0"
    assert musubi_module("nonsense_1") is None


def test_wan_format_alpha_diff_b_and_zero_norms(model):
    state, _ = wan_lora(model, rank=4, alpha=8.0)
    contents = parse_lora(state)
    assert contents.format == "wan" and contents.unknown == () and contents.image_keys == ()
    targets = by_weight(contents)
    q = targets["blocks.0.attn1.to_q.weight"]
    assert q.low_rank.rank == 4 and q.low_rank.alpha == 8.0 and q.low_rank.scale == 2.0
    assert torch.equal(q.low_rank.down, state["diffusion_model.blocks.0.self_attn.q.lora_down.weight"])
    assert q.bias == "blocks.0.attn1.to_q.bias" and q.bias_scale == 1.0
    assert torch.equal(q.bias_delta, state["diffusion_model.blocks.0.self_attn.q.diff_b"])
    assert set(q.keys) == {
        f"diffusion_model.blocks.0.self_attn.q.{s}"
        for s in ("lora_down.weight", "lora_up.weight", "alpha", "diff_b")
    }
    assert targets["blocks.1.attn2.to_out.0.weight"].bias is None
    # 5 zero norm deltas + 1 zero norm bias delta per block, each ignored with its reason
    assert len(contents.ignored) == 12 and {r for _, r in contents.ignored} == {ZERO_REASON}
    assert all(".norm" in key for key, _ in contents.ignored)
    assert contents.key_count == len(state)


def test_wan_format_without_alpha_and_with_lora_a_b_names(model):
    state, _ = wan_lora(model, alpha=None, extras=False, up_down=False)
    contents = parse_lora(state)
    assert all(t.low_rank.scale == 1.0 and t.low_rank.alpha is None for t in contents.targets)
    assert len(contents.targets) == 2 * 10


def test_nonzero_diff_is_a_full_weight_delta():
    delta = torch.randn(32, 32)
    contents = parse_lora({"diffusion_model.blocks.0.self_attn.q.diff": delta})
    (target,) = contents.targets
    assert target.low_rank is None and torch.equal(target.weight_delta, delta)


def test_musubi_format_equals_wan_format(model):
    wan = by_weight(parse_lora(wan_lora(model, alpha=2.0, extras=False)[0]))
    musubi = parse_lora(musubi_lora(model, alpha=2.0)[0])
    assert musubi.format == "musubi" and musubi.unknown == ()
    for target in musubi.targets:
        same = wan[target.weight]
        assert (
            torch.equal(target.low_rank.up, same.low_rank.up) and target.low_rank.scale == same.low_rank.scale
        )


def test_diffusers_format_alpha_from_metadata_and_pattern(model):
    state, metadata = diffusers_lora(model, rank=4, alpha=8.0, bias=True)
    contents = parse_lora(state, metadata)
    targets = by_weight(contents)
    assert contents.format == "diffusers" and contents.unknown == ()
    assert targets["blocks.0.attn1.to_q.weight"].low_rank.scale == 2.0
    assert targets["blocks.1.ffn.net.2.weight"].low_rank.scale == 1.0  # alpha_pattern: alpha 4 / rank 4
    assert targets["blocks.0.attn1.to_q.weight"].bias_scale == 2.0  # PEFT scales lora_B.bias too
    no_meta = parse_lora(state, None)
    assert {t.low_rank.scale for t in no_meta.targets} == {1.0}  # diffusers: alpha = rank without metadata
    packed = json.loads(metadata["lora_adapter_metadata"])
    packed["transformer.use_rslora"] = True
    rs = by_weight(parse_lora(state, {"lora_adapter_metadata": json.dumps(packed)}))
    assert math.isclose(rs["blocks.0.attn1.to_q.weight"].low_rank.scale, 8.0 / 2.0)  # alpha / sqrt(4)


def test_image_keys_map_to_diffusers_add_projections():
    state = {
        "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": torch.randn(2, 32),
        "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": torch.randn(32, 2),
        "diffusion_model.blocks.0.cross_attn.v_img.lora_down.weight": torch.randn(2, 32),
        "diffusion_model.blocks.0.cross_attn.v_img.lora_up.weight": torch.randn(32, 2),
    }
    contents = parse_lora(state)
    assert sorted(t.weight for t in contents.targets) == [
        "blocks.0.attn2.add_k_proj.weight",
        "blocks.0.attn2.add_v_proj.weight",
    ]
    assert len(contents.image_keys) == 4


def test_unknown_keys_are_returned_not_dropped():
    state = {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(2, 32),
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(32, 2),
        "diffusion_model.blocks.0.mystery.lora_down.weight": torch.randn(2, 32),
        "diffusion_model.blocks.0.self_attn.q.dora_scale": torch.randn(32),
        "other.key": torch.randn(1),
    }
    contents = parse_lora(state)
    assert sorted(contents.unknown) == [
        "diffusion_model.blocks.0.mystery.lora_down.weight",
        "diffusion_model.blocks.0.self_attn.q.dora_scale",
        "other.key",
    ]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(2, 32)},
            "no matching lora_up",
        ),
        (
            {
                "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(2, 32),
                "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(32, 3),
            },
            "not a low-rank pair",
        ),
        ({"model.layers.0.q.lora_A.weight": torch.randn(2, 3)}, "unknown key layout"),
        (
            {
                "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(2, 32),
                "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(32, 2),
                "diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.randn(2, 32),
            },
            "both lora_down/lora_up and lora_A/lora_B",
        ),
    ],
)
def test_malformed_state_is_a_one_line_error(state, message):
    with pytest.raises(ValidationError, match=message) as info:
        parse_lora(state, source="bad.safetensors")
    assert "\n" not in str(info.value) and "bad.safetensors" in str(info.value)


def test_reader_hashes_file_and_names_it_on_errors(model, tmp_path):
    path = save(tmp_path / "good.safetensors", *wan_lora(model))
    lora = read_lora_file(path)
    import hashlib

    assert lora.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LoadError, match="truncated.safetensors"):
        read_lora_file(truncated)
    ints = save(
        tmp_path / "ints.safetensors",
        {
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(2, 32, dtype=torch.int32),
            "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(32, 2),
        },
    )
    with pytest.raises(LoadError, match=r"ints\.safetensors.*int32"):
        read_lora_file(ints)
    with pytest.raises(LoadError, match="not found"):
        read_lora_file(tmp_path / "missing.safetensors")


def test_request_parsing():
    assert LoRARequest.parse("a/b.safetensors") == LoRARequest(Path("a/b.safetensors"), 1.0, None)
    assert LoRARequest.parse("b.safetensors:0.5") == LoRARequest(Path("b.safetensors"), 0.5, None)
    assert LoRARequest.parse("b.safetensors:-1@1") == LoRARequest(Path("b.safetensors"), -1.0, (1,))
    assert LoRARequest.parse("b.safetensors@1,0").experts == (0, 1)
    assert LoRARequest.parse("c:/x/b.safetensors").path == Path("c:/x/b.safetensors")
    for bad in ("b.safetensors:nan", "b.safetensors@x", "@0", "b.safetensors@-1"):
        with pytest.raises(ValidationError):
            LoRARequest.parse(bad)
    assert LoRARequest.coerce({"path": "x", "strength": 2, "experts": [1]}).strength == 2.0
    with pytest.raises(ValidationError, match="allowed keys"):
        LoRARequest.coerce({"path": "x", "weight": 2})


def test_a_bad_strength_is_named_not_read_as_part_of_the_path(tmp_path, capsys):
    from mmgen.cli import main

    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")
    for text in (f"{lora}:abc", "missing.safetensors:0,8", f"{lora}:abc@1"):
        with pytest.raises(ValidationError, match=r"strength '(abc|0,8)' is not a number"):
            LoRARequest.parse(text)
    # on the command line: one line about the strength, not "file not found"
    assert main(["generate", "x", "--lora", f"{lora}:abc", "--out", str(tmp_path / "o.mp4")]) == 2
    err = capsys.readouterr().err
    assert "strength 'abc' is not a number" in err and "not found" not in err
    # a ':' that really is part of an existing path still reads as the path
    odd = tmp_path / "odd:name"
    odd.write_bytes(b"")
    assert LoRARequest.parse(str(odd)).path == odd
