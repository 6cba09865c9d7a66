"""The one request value (pipelines.request): validation once, with errors naming field, value and allowed."""

from __future__ import annotations

import pytest

from mmgen.attention.selection import BACKEND_NAMES
from mmgen.errors import ValidationError
from pipelines.request import GenerationRequest
from pipelines.request_properties import (
    AB_VARIABLES,
    field_flag,
    field_property,
    field_role,
    fields_with_role,
    lossy_args,
    recorded_fields,
)

PROMPT = "a red circle moves right on a black background"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"num_frames": 7}, "num_frames = 7: must be 4k+1"),
        ({"height": 16384}, "height = 16384: must be at most 8192"),
        ({"height": 20}, "height = 20: must be a positive multiple of 16 (nearest: 16 or 32)"),
        ({"width": "64"}, "width = '64'"),
        ({"offload": "lay"}, "offload = 'lay': allowed values are 'none', 'model', 'layer'"),
        ({"decode": "x"}, "decode = 'x': allowed values are"),
        ({"lora": "missing.safetensors:0.5"}, "lora: file(s) not found: missing.safetensors"),
        ({"accel": "fast", "step_cache": 1.0}, "step_cache = 1.0 conflicts with accel 'fast'"),
        ({"preset": "distill-4step", "num_inference_steps": 8}, "conflicts with preset 'distill-4step'"),
        ({"hieght": 64}, "unknown request field(s) hieght; allowed: prompt,"),
        ({"prompt": ""}, "prompt: must not be empty"),
        ({"guidance_scale_2": -1}, "guidance_scale_2 = -1: must be a finite number >= 0"),
        ({"attention_backend": "nope"}, "attention_backend = 'nope': unknown; allowed: auto"),
        ({"image": "nope.png"}, "image: nope.png: file not found"),
        ({"compile": "yes"}, "compile = 'yes'"),
        ({"seed": -1}, "seed = -1: must be an integer in [0, 2**63 - 1]"),
        ({"seed": True}, "seed = True"),
        ({"step_cache": -1}, "step_cache = -1: must be a number >= 0"),
        ({"cfg_truncation": 0}, "cfg_truncation = 0: must be a fraction in (0, 1]"),
        ({"gpu_memory_gb": 0}, "gpu_memory_gb = 0: must be a number > 0"),
        ({"max_sequence_length": 1}, "max_sequence_length"),
        ({"ffn_chunk": 0}, "ffn_chunk"),
    ],
)
def test_a_bad_field_is_one_error_naming_it(fields, expected):
    with pytest.raises(ValidationError) as err:
        GenerationRequest.from_call(**{"prompt": PROMPT, **fields})
    assert expected in str(err.value)


def test_values_are_normalized_once_and_frozen():
    request = GenerationRequest.from_call(prompt=PROMPT, guidance_scale=5, gpu_memory_gb=4, seed=3)
    assert request.guidance_scale == 5.0 and isinstance(request.guidance_scale, float)
    assert request.gpu_memory_gb == 4.0 and request.seed == 3
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        request.height = 64  # type: ignore[misc]
    assert request.model_fields_set == {"prompt", "guidance_scale", "gpu_memory_gb", "seed"}


def test_the_record_builds_the_same_request_again(tmp_path):
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"not read here")
    request = GenerationRequest.from_call(
        prompt=PROMPT, height=64, lora=f"{lora}:0.5", step_cache=1.5, fp8_linear=True, cfg="sequential"
    )
    record = request.record()
    assert record["lora"] == [{"path": str(lora), "strength": 0.5, "experts": None, "sha256": None}]
    again = GenerationRequest.from_call(**record)
    assert again == request
    assert request.declared() == {
        "lora": record["lora"],
        "step_cache": 1.5,
        "fp8_linear": True,
    }
    # `loras` (the render file's and the server's plural) names the same field
    assert GenerationRequest.from_call(prompt=PROMPT, loras=[str(lora)]).lora[0].path == lora


def test_roles_and_flags():
    assert set(fields_with_role("job")) >= {"prompt", "height", "width", "num_frames", "seed", "image"}
    assert field_role("fp8_attention") == "lossy" and field_role("offload") == "run"
    assert set(AB_VARIABLES) == set(fields_with_role("run", "lossy"))
    assert not set(AB_VARIABLES) & set(fields_with_role("job"))
    assert field_flag("num_frames") == "--frames" and field_flag("gpu_memory_gb") == "--gpu-memory-gb"
    backend = GenerationRequest.model_fields["attention_backend"]
    assert all(name in backend.description for name in BACKEND_NAMES)


def test_the_field_lists_are_properties_of_the_fields():
    # ab's fingerprint allowances, the recorded fields and the lossy args are declared on the fields.
    from mmgen.render import ab
    from pipelines import record

    assert {name: field_property(name, "fingerprint") for name in AB_VARIABLES} == {
        name: ab.DECLARED_FINGERPRINT_FIELDS[name] for name in AB_VARIABLES
    }
    assert field_property("fp8_attention", "fingerprint") == ("attention_providers", "attention_providers.*")
    assert record.RECORDED_FIELDS == recorded_fields()
    assert {"prompt", "seed", "num_inference_steps", "preset"} <= set(recorded_fields())
    assert ab.LOSSY_ARGS == lossy_args()
    for name in fields_with_role("lossy"):  # a lossy field's args are named after it
        assert all(key.startswith(name) for key in field_property(name, "lossy_args", ())), name
    assert {"step_cache_reused", "accel_skipped", "fp8_linear_layers"} <= set(lossy_args())
    assert not hasattr(record, "LOSSY_FIELDS")  # read by nothing: gone
