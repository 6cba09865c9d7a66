"""mmgen's tokenizers-based TextTokenizer against transformers' tokenizers on the same directory."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer

WORDS = ["a", "cat", "dog", "runs", "on", "the", "green", "grass", "under", "red", "sky"]
PROMPTS = [
    "a cat runs on the grass",
    "",
    "  the red   dog\truns under a\nsky  ",
    " ".join(["cat", "dog"] * 12),  # longer than max_length: cut, keeping the final </s>
    "dogs and cats: unseen words, XYZ!",
    "a cat</s>dog <pad> sky",
]
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_word_tokenizer(WORDS, directory, model_max_length=64)
    return directory


def _reference_tokenizers(directory):
    """The ways diffusers / users load this directory with transformers."""
    return {
        "AutoTokenizer": transformers.AutoTokenizer.from_pretrained(directory),
        "T5TokenizerFast": transformers.T5TokenizerFast.from_pretrained(directory),
        "PreTrainedTokenizerFast(tokenizer_file)": transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json"), pad_token="<pad>", eos_token="</s>"
        ),
    }


def test_layout_and_round_trip(tokenizer_dir):
    tok = TextTokenizer.from_dir(tokenizer_dir)
    assert tok.pad_id == 0 and tok.pad_token == "<pad>"
    assert [tok.tokenizer.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert tok.model_max_length == 64
    ids, mask = tok.encode(["a cat runs on the grass"], MAX_LENGTH)
    words = [tok.tokenizer.token_to_id("\u2581" + w) for w in ("a", "cat", "runs", "on", "the", "grass")]
    assert ids[0, :7].tolist() == words + [1]
    assert ids[0, 7:].tolist() == [0] * (MAX_LENGTH - 7)
    assert mask[0].tolist() == [1] * 7 + [0] * (MAX_LENGTH - 7)
    assert tok.tokenizer.decode(ids[0].tolist()) == "a cat runs on the grass"
    # Deterministic: building again gives the same file bytes.
    again = tokenizer_dir.parent / "again"
    build_word_tokenizer(WORDS, again, model_max_length=64)
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("max_length", [MAX_LENGTH, 4])
def test_matches_transformers(tokenizer_dir, max_length):
    ids, mask = TextTokenizer.from_dir(tokenizer_dir).encode(PROMPTS, max_length)
    assert ids.dtype == mask.dtype == torch.int64
    assert ids.shape == mask.shape == (len(PROMPTS), max_length)
    assert mask[1].sum().item() == 1 and ids[1, 0].item() == 1  # empty prompt -> just </s>
    assert mask[3].all() and ids[3, -1].item() == 1  # truncated prompt keeps </s> last
    for name, reference in _reference_tokenizers(tokenizer_dir).items():
        want = reference(
            PROMPTS,
            padding="max_length",
            max_length=max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        assert torch.equal(ids, want.input_ids), name
        assert torch.equal(mask, want.attention_mask), name


def test_pad_token_and_limit_from_configs(tmp_path):
    build_word_tokenizer(WORDS, tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    special = {"pad_token": {"content": "</s>", "special": True}}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special))
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.pad_id == 1 and tok.model_max_length is None
    ids, mask = tok.encode(["cat"], 5)
    assert ids.tolist() == [[tok.tokenizer.token_to_id("\u2581cat"), 1, 1, 1, 1]]
    assert mask.tolist() == [[1, 1, 0, 0, 0]]


def test_stored_padding_and_truncation_do_not_leak(tmp_path):
    build_word_tokenizer(WORDS, tmp_path)
    path = tmp_path / "tokenizer.json"
    data = json.loads(path.read_text())
    data["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(data))
    ids, mask = TextTokenizer.from_dir(tmp_path).encode(["a cat runs on the grass"], 10)
    assert mask[0].sum().item() == 7


def test_errors(tmp_path):
    with pytest.raises(LoadError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    build_word_tokenizer(WORDS, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(LoadError, match="<nope>"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tok = TextTokenizer.from_dir(tmp_path)
    with pytest.raises(ValidationError, match="max_length"):
        tok.encode(["cat"], 1)
    with pytest.raises(ValidationError, match="list of strings"):
        tok.encode("cat", 8)
    with pytest.raises(ValidationError, match="duplicates"):
        build_word_tokenizer(["cat", "cat"], tmp_path / "dup")
    with pytest.raises(ValidationError, match="whitespace"):
        build_word_tokenizer(["two words"], tmp_path / "space")
