"""mmgen's UMT5 encoder against transformers' UMT5EncoderModel on tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.umt5 import load_umt5_encoder
from mmgen.models.umt5 import TextPadding, UMT5Config, UMT5Encoder, relative_position_buckets

TINY = dict(
    vocab_size=96,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
)


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """HF initializes every norm to 1.0; random scales make the test see a swapped or skipped norm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))


def _save_hf(
    directory: Path, model_cls: type = transformers.UMT5EncoderModel, **overrides
) -> torch.nn.Module:
    config = transformers.UMT5Config(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    _randomize_norms(model, seed=1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _batch(
    length: int, lengths: list[int], vocab: int = 96, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, length] (pad id 0) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), length), generator=gen)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    return ids * mask, mask


@pytest.mark.parametrize(
    "overrides",
    [{}, {"feed_forward_proj": "relu"}, {"feed_forward_proj": "gated-silu"}],
    ids=["gated-gelu", "relu", "gated-silu"],
)
@pytest.mark.parametrize("length,lengths", [(12, [12, 7, 1]), (40, [40, 23, 3])])
def test_matches_transformers_on_padded_batch(tmp_path, overrides, length, lengths):
    hf = _save_hf(tmp_path, **overrides)
    ours = load_umt5_encoder(tmp_path, dtype=torch.float32, device="cpu")
    ids, mask = _batch(length, lengths)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, TextPadding.from_mask(mask))
        got_from_mask = ours(ids, attention_mask=mask)
    assert got.shape == (3, length, 32)
    # Padded positions attend to the real tokens in HF too, so every position is comparable.
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got, got_from_mask)
    # The padded rows really differ from an unmasked run (the mask reaches every layer).
    with torch.no_grad():
        unmasked = hf(input_ids=ids).last_hidden_state
    assert (unmasked[2] - want[2]).abs().max().item() > 1e-3


def test_unpadded_batch_and_no_metadata(tmp_path):
    hf = _save_hf(tmp_path)
    ours = load_umt5_encoder(tmp_path, dtype=torch.float32, device="cpu")
    ids, _ = _batch(20, [20, 20])
    with torch.no_grad():
        want = hf(input_ids=ids).last_hidden_state
        assert (ours(ids) - want).abs().max().item() <= 1e-5
        assert (ours(ids, TextPadding.full(2, 20)) - want).abs().max().item() <= 1e-5


def test_buckets_match_transformers():
    config = transformers.UMT5Config(**TINY)
    attention = transformers.models.umt5.modeling_umt5.UMT5Attention(config, has_relative_attention_bias=True)
    for length in (1, 5, 33, 70):
        positions = torch.arange(length)
        want = attention._relative_position_bucket(positions[None, :] - positions[:, None])
        assert torch.equal(relative_position_buckets(length, 8, 16, "cpu"), want)


def test_fp16_keeps_wo_in_fp32_like_transformers(tmp_path):
    _save_hf(tmp_path)
    hf = transformers.UMT5EncoderModel.from_pretrained(tmp_path, dtype=torch.float16).eval()
    ours = load_umt5_encoder(tmp_path, dtype=torch.float16, device="cpu")
    for i in range(2):
        hf_wo = hf.encoder.block[i].layer[1].DenseReluDense.wo.weight
        our_wo = ours.encoder.block[i].layer[1].DenseReluDense.wo.weight
        assert hf_wo.dtype == our_wo.dtype == torch.float32
        assert torch.equal(hf_wo, our_wo)
    assert ours.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float16
    ids, mask = _batch(12, [12, 6, 2])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, TextPadding.from_mask(mask))
    assert got.dtype == want.dtype == torch.float16
    assert (got.float() - want.float()).abs().max().item() <= 1e-2


def test_full_encoder_decoder_checkpoint_loads_encoder(tmp_path):
    hf = _save_hf(tmp_path, model_cls=transformers.UMT5ForConditionalGeneration)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert any(k.startswith("decoder.") for k in keys)
    ours = load_umt5_encoder(tmp_path)
    ids, mask = _batch(12, [12, 4, 9])
    with torch.no_grad():
        want = hf.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (ours(ids, attention_mask=mask) - want).abs().max().item() <= 1e-5


def test_embedding_stored_under_tied_alias(tmp_path):
    hf = _save_hf(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["encoder.embed_tokens.weight"] = tensors.pop("shared.weight")
    save_file(tensors, str(path))
    ours = load_umt5_encoder(tmp_path)
    assert torch.equal(ours.shared.weight, hf.shared.weight)
    # Both names present (same tensor) is also fine.
    tensors["shared.weight"] = tensors["encoder.embed_tokens.weight"].clone()
    save_file(tensors, str(path))
    assert torch.equal(load_umt5_encoder(tmp_path).shared.weight, hf.shared.weight)


def test_no_meta_tensors_and_state_dict_names(tmp_path):
    hf = _save_hf(tmp_path)
    ours = load_umt5_encoder(tmp_path)
    assert not any(p.is_meta for p in ours.parameters())
    assert set(ours.state_dict()) == set(load_file(str(tmp_path / "model.safetensors")))
    assert set(ours.state_dict()) == set(hf.state_dict()) - {"encoder.embed_tokens.weight"}


def test_config_round_trip_through_transformers(tmp_path):
    _save_hf(tmp_path)
    config = UMT5Config.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert config.dense_act_fn == "gelu_new" and config.is_gated_act
    hf_config = transformers.UMT5Config(**config.to_hf_config())
    assert UMT5Config.from_hf_config(hf_config.to_dict()) == config
    # A checkpoint written from our own module (as the embedded default does) loads in transformers.
    torch.manual_seed(3)
    ours = UMT5Encoder(config).eval()
    _randomize_norms(ours, seed=4)
    out = tmp_path / "ours"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_hf_config()))
    hf = transformers.UMT5EncoderModel.from_pretrained(out).eval()
    ids, mask = _batch(10, [10, 3])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (ours(ids, attention_mask=mask) - want).abs().max().item() <= 1e-5


def test_wrong_shape_names_file_and_tensor(tmp_path):
    _save_hf(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    name = "encoder.block.1.layer.0.SelfAttention.k.weight"
    tensors[name] = torch.zeros(32, 31)
    save_file(tensors, str(path))
    with pytest.raises(LoadError) as err:
        load_umt5_encoder(tmp_path)
    assert str(path) in str(err.value) and name in str(err.value) and "\n" not in str(err.value)


def test_unknown_and_missing_tensors(tmp_path):
    _save_hf(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["encoder.block.0.layer.2.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(LoadError, match=r"encoder\.block\.0\.layer\.2\.extra\.weight"):
        load_umt5_encoder(tmp_path)
    del tensors["encoder.block.0.layer.2.extra.weight"]
    del tensors["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"]
    save_file(tensors, str(path))
    with pytest.raises(LoadError, match=r"relative_attention_bias"):
        load_umt5_encoder(tmp_path)


def test_config_errors(tmp_path):
    with pytest.raises(LoadError, match="config.json"):
        load_umt5_encoder(tmp_path)
    with pytest.raises(LoadError, match="not found"):
        load_umt5_encoder(tmp_path / "absent")
    _save_hf(tmp_path)
    config_path = tmp_path / "config.json"
    hf = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**hf, "model_type": "t5"}))
    with pytest.raises(LoadError, match="model_type 't5'"):
        load_umt5_encoder(tmp_path)
    config_path.write_text(json.dumps({k: v for k, v in hf.items() if k != "d_kv"}))
    with pytest.raises(LoadError, match="d_kv"):
        load_umt5_encoder(tmp_path)
    config_path.write_text(json.dumps({**hf, "feed_forward_proj": "gated-mish", "dense_act_fn": "mish"}))
    with pytest.raises(LoadError, match="mish"):
        load_umt5_encoder(tmp_path)


def test_padding_metadata_is_validated_and_frozen():
    padding = TextPadding.from_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert padding.lengths.tolist() == [2, 3]
    with pytest.raises(AttributeError):
        padding.lengths = torch.tensor([1, 1])
    with pytest.raises(ValidationError, match="right-padded"):
        TextPadding.from_mask(torch.tensor([[0, 1, 1]]))
    key_mask = padding.additive_key_mask(3, torch.float32, "cpu")
    assert key_mask.shape == (2, 1, 1, 3)
    assert key_mask[0, 0, 0].tolist() == [0.0, 0.0, torch.finfo(torch.float32).min]
