"""Malformed config files end in one LoadError naming the file and the field, never an AttributeError."""

from __future__ import annotations

import json

import pytest

from mmgen.errors import LoadError
from mmgen.loading.safetensors_dir import read_json
from mmgen.loading.umt5 import read_umt5_config

UMT5_SHAPE = {"model_type": "umt5", "vocab_size": 8, "d_model": 8, "d_kv": 4, "d_ff": 8, "num_layers": 1}


@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ('"config"', "str"), ("3", "int")])
def test_read_json_refuses_a_non_object(tmp_path, text, kind):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(LoadError, match=rf"config\.json: expected a JSON object, got {kind}"):
        read_json(path)


def test_read_json_returns_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}


@pytest.mark.parametrize(
    "field, value",
    [("layer_norm_epsilon", "1e-6x"), ("layer_norm_epsilon", True), ("feed_forward_proj", 5)],
)
def test_umt5_config_field_of_wrong_type_names_file_and_field(tmp_path, field, value):
    (tmp_path / "config.json").write_text(json.dumps({**UMT5_SHAPE, "num_heads": 2, field: value}))
    with pytest.raises(LoadError, match=rf"config\.json: UMT5 config: {field}"):
        read_umt5_config(tmp_path)


T5GEMMA_STACK = {
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"encoder": {**T5GEMMA_STACK, "num_hidden_layers": "2"}}, r"\[encoder\]: num_hidden_layers = '2'"),
        ({"decoder": {**T5GEMMA_STACK, "rope_scaling": "x"}}, r"\[decoder\]: rope_parameters / rope_scaling"),
        ({"decoder_start_token_id": "a"}, r"config\.json: decoder start token = 'a'"),
        ({"eos_token_id": ["a"]}, r"config\.json: eos_token_id = \['a'\]"),
    ],
)
def test_t5gemma_config_field_of_wrong_type_names_file_and_field(tmp_path, change, message):
    from mmgen.llm.models.t5gemma_loading import read_t5gemma_config

    raw = {
        "model_type": "t5gemma",
        "encoder": T5GEMMA_STACK,
        "decoder": T5GEMMA_STACK,
        "decoder_start_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(LoadError, match=message):
        read_t5gemma_config(tmp_path)


def test_t5gemma_eos_ids_from_generation_config(tmp_path):
    from mmgen.llm.models.t5gemma_loading import read_t5gemma_config

    raw = {
        "model_type": "t5gemma",
        "encoder": T5GEMMA_STACK,
        "decoder": T5GEMMA_STACK,
        "decoder_start_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps({**raw, "eos_token_id": 1}))
    assert read_t5gemma_config(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert read_t5gemma_config(tmp_path).eos_token_ids == (1, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1.5}))
    with pytest.raises(LoadError, match=r"generation_config\.json: eos_token_id = 1\.5"):
        read_t5gemma_config(tmp_path)


def test_from_pretrained_takes_dtypes_and_devices_by_name_and_refuses_others_in_one_line(
    default_model_dir, tmp_path, capsys
):
    # Seen: dtype="float32" ended in a torch TypeError while loading, dtype=torch.int8 in a
    # state-dict error, and --model FILE said "directory not found".
    import torch

    from mmgen.cli import main
    from mmgen.errors import ValidationError
    from mmgen.families import load_pipeline
    from mmgen.loading.diffusers_dir import read_model_index
    from pipelines.loader import check_device, check_dtype, resolve_dtype
    from pipelines.wan_t2v import WanT2VPipeline

    for names, dtype in (
        (("float32", "fp32", "torch.float32"), torch.float32),
        (("bfloat16", "bf16"), torch.bfloat16),
        (("float16", "fp16"), torch.float16),
    ):
        for name in (*names, dtype):
            assert check_dtype(name) == dtype and check_dtype(torch_dtype=name) == dtype
            assert check_dtype(None, torch_dtype=name) == dtype
    assert check_dtype() == torch.float32 and resolve_dtype("fp16", "cpu") == "float16"
    for bad in (torch.int8, "int8", "float", 32, torch.float64):
        with pytest.raises(ValidationError, match=r"allowed torch.float32, .*float32\|fp32"):
            check_dtype(bad)
    with pytest.raises(ValidationError, match="disagree"):
        check_dtype("fp16", torch_dtype=torch.bfloat16)
    assert check_device("cpu") == "cpu" and check_device(torch.device("cpu")) == "cpu"
    with pytest.raises(ValidationError, match="'gpu': not a device"):
        check_device("gpu")

    pipe = WanT2VPipeline.from_pretrained(default_model_dir, dtype="float32", device="cpu")
    assert pipe.dtype == torch.float32
    pipe = WanT2VPipeline.from_pretrained(default_model_dir, torch_dtype="bf16", device=torch.device("cpu"))
    assert pipe.dtype == torch.bfloat16
    with pytest.raises(ValidationError, match=r"dtype torch.int8: allowed"):
        WanT2VPipeline.from_pretrained(default_model_dir, dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match=r"^device 'cuda': CUDA is not available here; use cpu$"):
            WanT2VPipeline.from_pretrained(default_model_dir, device="cuda")

    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ValidationError, match="is a file; expected a model directory"):
        load_pipeline(file, task="t2v", device="cpu", dtype="fp32")
    with pytest.raises(LoadError, match="a file; expected a model directory"):
        read_model_index(file)
    assert main(["generate", "x", "--model", str(file), "--out", str(tmp_path / "o.mp4")]) == 2
    assert "--model" in (err := capsys.readouterr().err) and "a file, expected a model directory" in err
