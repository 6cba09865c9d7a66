"""Qwen-Image's tokenizer, text encoder and directory loader against transformers' and diffusers' own.

A tiny Qwen2 tokenizer (tests/qwen_image_cases.py) in both layouts (vocab.json + merges.txt as Qwen
ships it, and tokenizer.json) gives transformers' Qwen2Tokenizer's ids; a tiny random Qwen2.5-VL,
saved by diffusers' QwenImagePipeline.save_pretrained and loaded by mmgen, gives the prompt states of
diffusers' QwenImagePipeline._get_qwen_prompt_embeds bit for bit, with its config.json in the
transformers 5.x (text_config) form and in the 4.x flat form.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from qwen_image_cases import hf_tokenizer, write_tokenizer

from mmgen.errors import LoadError
from mmgen.loading.qwen_image_dir import (
    is_qwen_image_dir,
    load_qwen_image_components,
    load_qwen_text_encoder,
    read_qwen_model_index,
)
from mmgen.loading.qwen_tokenizer import QwenTokenizer
from mmgen.models.qwen_image_prompt import MAX_TEXT_TOKENS, templated_prompts

TEXTS = [
    *templated_prompts(["a red cat sits on a green mat", "Ünïcödé 123 it's\n\nthe cat's  im", " "]),
    "<|im_start|>cat<|im_end|>\n",
    " cat at eat",
]
PROMPTS = ["a red cat sits on a green mat, photo", "sky", " "]


@pytest.fixture(scope="module")
def components(qwen_image_dir):
    return load_qwen_image_components(qwen_image_dir, dtype=torch.float32)


def test_tokenizer_layouts_match_transformers(tmp_path):
    pytest.importorskip("transformers")
    source = tmp_path / "vocab_merges"
    write_tokenizer(source)
    reference = hf_tokenizer(source)
    fast = tmp_path / "fast"
    reference.save_pretrained(str(fast))
    assert (fast / "tokenizer.json").is_file()
    for directory in (source, fast):
        ours = QwenTokenizer.from_dir(directory)
        assert ours.vocab_size == len(reference)
        for text in TEXTS:
            assert ours.encode(text) == reference(text).input_ids, (directory.name, text)
        assert (
            ours.encode(TEXTS[0], max_length=7)
            == reference(TEXTS[0], max_length=7, truncation=True).input_ids
        )


def test_tokenizer_errors(tmp_path):
    with pytest.raises(LoadError, match="no tokenizer.json, nor vocab.json"):
        QwenTokenizer.from_dir(tmp_path)
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"999": config["added_tokens_decoder"].popitem()[1]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="should have id 999"):
        QwenTokenizer.from_dir(tmp_path)


def _reference(qwen_image_dir, prefix_tokens):
    import diffusers

    pipe = diffusers.QwenImagePipeline.from_pretrained(str(qwen_image_dir), local_files_only=True)
    pipe.prompt_template_encode_start_idx = prefix_tokens  # the tiny tokenizer's prefix (Qwen's: 34)
    return pipe


def _ours(components, prompts, max_tokens=MAX_TEXT_TOKENS):
    limit = MAX_TEXT_TOKENS + components.text_encoder.prefix_tokens
    ids = [components.tokenizer.encode(text, max_length=limit) for text in templated_prompts(prompts)]
    return components.text_encoder.encode(ids, max_tokens=max_tokens)


def test_text_states_match_diffusers(qwen_image_dir, components):
    """Each prompt alone (as diffusers encodes a request's prompt and negative prompt): equal bits."""
    reference = _reference(qwen_image_dir, components.text_encoder.prefix_tokens)
    text, text_lens = _ours(components, PROMPTS)
    assert len(set(text_lens.tolist())) == len(PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected, mask = reference._get_qwen_prompt_embeds([prompt], device=torch.device("cpu"))
        length = int(text_lens[row])
        assert length == int(mask.sum())
        assert torch.equal(text[row, :length], expected[0])
        assert not text[row, length:].any()
    cut, cut_lens = _ours(components, PROMPTS, max_tokens=5)
    assert cut_lens.tolist() == [5, 5, 5] and torch.equal(cut, text[:, :5])


def test_text_encoder_config_forms(qwen_image_dir, components, tmp_path):
    """transformers 4.x's flat config.json (text fields at the top, rope_scaling) loads the same model."""
    flat = tmp_path / "text_encoder"
    shutil.copytree(qwen_image_dir / "text_encoder", flat)
    config = json.loads((flat / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    config.update(
        rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}, rope_theta=rope["rope_theta"]
    )
    (flat / "config.json").write_text(json.dumps(config))
    encoder = load_qwen_text_encoder(flat, tokenizer=components.tokenizer, dtype=torch.float32, device="cpu")
    ids = [components.tokenizer.encode(text) for text in templated_prompts(PROMPTS[:2])]
    assert torch.equal(encoder.encode(ids)[0], components.text_encoder.encode(ids)[0])


def test_model_index_checks(qwen_image_dir, tmp_path):
    assert is_qwen_image_dir(qwen_image_dir) and not is_qwen_image_dir(tmp_path)
    assert read_qwen_model_index(qwen_image_dir)["vae"][1] == "AutoencoderKLQwenImage"
    broken = tmp_path / "broken"
    shutil.copytree(qwen_image_dir, broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderKLWan"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="vae class 'AutoencoderKLWan' is not supported"):
        read_qwen_model_index(broken)
    shutil.rmtree(broken / "scheduler")
    index["vae"] = ["diffusers", "AutoencoderKLQwenImage"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="scheduler: component directory not found"):
        read_qwen_model_index(broken)
