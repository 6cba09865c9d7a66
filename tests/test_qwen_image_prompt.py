"""Qwen-Image's prompt template and prefix drop against diffusers' QwenImagePipeline on a tiny Qwen2.5-VL.

The tokenizer is a byte-level BPE made offline with `tokenizers` (every byte one token, plus Qwen's
chat special tokens); the text encoder a random two-layer Qwen2_5_VLForConditionalGeneration. With
this tokenizer the template prefix is longer than Qwen's 34 tokens, so both sides drop the count
this tokenizer gives (diffusers through its prompt_template_encode_start_idx attribute).
"""

from __future__ import annotations

import pytest
import torch
from qwen_image_cases import tiny_text_encoder

from mmgen.errors import ValidationError
from mmgen.models.qwen_image_prompt import (
    MAX_TEXT_TOKENS,
    PROMPT_TEMPLATE,
    TEMPLATE_PREFIX_TOKENS,
    drop_template_prefix,
    template_prefix_tokens,
    templated_prompts,
)

PROMPTS = ["a red cat sits on a green mat, photo", "sky", " "]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def pipeline():
    """diffusers' QwenImagePipeline holding only the tiny tokenizer and text encoder."""
    diffusers = pytest.importorskip("diffusers")
    tokenizer = _tokenizer()
    pipe = diffusers.QwenImagePipeline(
        scheduler=None,
        vae=None,
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=None,
    )
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == TEMPLATE_PREFIX_TOKENS
    assert pipe.tokenizer_max_length == MAX_TEXT_TOKENS
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(_counter(tokenizer))
    return pipe


def _counter(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def _ours(pipe, prompts, max_tokens=MAX_TEXT_TOKENS):
    prefix = template_prefix_tokens(_counter(pipe.tokenizer))
    tokens = pipe.tokenizer(
        templated_prompts(prompts),
        max_length=MAX_TEXT_TOKENS + prefix,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        states = pipe.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states[-1]
    return drop_template_prefix(states, tokens.attention_mask, prefix_tokens=prefix, max_tokens=max_tokens)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_prompt_states_match_diffusers(pipeline, padding_side):
    pipeline.tokenizer.padding_side = padding_side
    with torch.no_grad():
        expected, mask = pipeline._get_qwen_prompt_embeds(PROMPTS, device=torch.device("cpu"))
    text, text_lens = _ours(pipeline, PROMPTS)
    assert text_lens.tolist() == mask.sum(dim=1).tolist()
    assert len(set(text_lens.tolist())) == len(PROMPTS)  # different lengths: a real padded batch
    for row, length in enumerate(text_lens.tolist()):
        assert mask[row, :length].all() and not mask[row, length:].any()
    assert torch.equal(text, expected)


def test_max_tokens_cuts_like_encode_prompt(pipeline):
    pipeline.tokenizer.padding_side = "right"
    with torch.no_grad():
        expected, mask = pipeline.encode_prompt(PROMPTS, device=torch.device("cpu"), max_sequence_length=5)
    text, text_lens = _ours(pipeline, PROMPTS, max_tokens=5)
    lens = [5] * len(PROMPTS) if mask is None else mask.sum(dim=1).tolist()
    assert text_lens.tolist() == lens
    assert torch.equal(text, expected)


def test_template_prefix_is_what_precedes_the_prompt():
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert templated_prompts(["x"])[0].startswith(prefix + "x<|im_end|>")
    assert template_prefix_tokens(len) == len(prefix)
    with pytest.raises(ValidationError, match="one string"):
        templated_prompts("a cat")
