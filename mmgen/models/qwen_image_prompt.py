"""Qwen-Image's text side around the encoder: the prompt template, and the template prefix dropped after it.

Qwen-Image conditions on the last hidden states of Qwen2.5-VL's language model run over each prompt
wrapped in a chat template (a system message asking for an image description, then the prompt as
the user's turn). The tokens of the template before the prompt (TEMPLATE_PREFIX_TOKENS with Qwen's
tokenizer) are dropped from the states; what remains (the prompt and the template's closing tokens)
is the text the transformer attends to. These are diffusers' QwenImagePipeline._get_qwen_prompt_embeds
and encode_prompt, as pure functions; mmgen returns per-prompt lengths instead of a mask.

Qwen-Image-Edit (EDIT_TEMPLATE) puts the input image in the user's turn before the prompt: the
vision tokens (<|vision_start|>, one <|image_pad|> per merged vision patch, <|vision_end|>) stay in
the text the transformer attends to; only the system message and the user header are dropped (64
tokens under Qwen's tokenizer: diffusers' QwenImageEditPipeline prompt_template_encode_start_idx).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmgen.errors import ValidationError

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_PREFIX_TOKENS = 34  # the template's tokens before the prompt, under Qwen2.5-VL's tokenizer
MAX_TEXT_TOKENS = 1024  # the prompt tokens kept at most (diffusers' tokenizer_max_length)
IMAGE_PAD = "<|image_pad|>"  # one per merged vision patch of the input image (Qwen2-VL's processor)
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|>" + IMAGE_PAD + "<|vision_end|>{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)


@dataclass(frozen=True)
class PromptTemplate:
    """A chat template: `text` with "{}" for the prompt; the states of the text before `kept_from` are
    dropped (prefix_tokens of them under Qwen2.5-VL's tokenizer)."""

    text: str
    kept_from: str
    prefix_tokens: int

    @property
    def prefix(self) -> str:
        return self.text.split(self.kept_from)[0]


T2I_TEMPLATE = PromptTemplate(PROMPT_TEMPLATE, "{}", TEMPLATE_PREFIX_TOKENS)
EDIT_TEMPLATE = PromptTemplate(EDIT_PROMPT_TEMPLATE, "<|vision_start|>", 64)


def templated_prompts(prompts: Sequence[str], template: PromptTemplate = T2I_TEMPLATE) -> list[str]:
    """Each prompt in the chat template; tokenize them with padding, truncation and
    max_length = MAX_TEXT_TOKENS + the prefix's token count (as diffusers does for T2I)."""
    if isinstance(prompts, str):
        raise ValidationError("prompts must be a sequence of strings, got one string")
    return [template.text.format(prompt) for prompt in prompts]


def expand_image_pads(text: str, image_tokens: int) -> str:
    """`text` with its one IMAGE_PAD repeated image_tokens times (what Qwen2-VL's processor does: the
    image's patch count / merge_size**2 tokens, which the encoder fills with the vision tower's states)."""
    if text.count(IMAGE_PAD) != 1 or image_tokens < 1:
        raise ValidationError(
            f"expected one {IMAGE_PAD} in the text and image_tokens >= 1, got {text.count(IMAGE_PAD)} and "
            f"{image_tokens}"
        )
    return text.replace(IMAGE_PAD, IMAGE_PAD * image_tokens)


def template_prefix_tokens(
    count_tokens: Callable[[str], int], template: PromptTemplate = T2I_TEMPLATE
) -> int:
    """The token count of the template's dropped prefix, under a tokenizer (count_tokens(text) -> the
    number of ids it encodes text to, without added special tokens). Qwen2.5-VL's gives
    template.prefix_tokens; a tokenizer that does not is not the one Qwen-Image was trained with."""
    return int(count_tokens(template.prefix))


def drop_template_prefix(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    prefix_tokens: int = TEMPLATE_PREFIX_TOKENS,
    max_tokens: int = MAX_TEXT_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's last hidden states [B, T, D] and attention mask [B, T] (1 = token, any padding
    side) -> text [B, L, D] with each prompt's states from column 0 and zeros after, and text_lens
    int64 [B] (CPU).

    Row b keeps its valid tokens in order, less the first prefix_tokens, at most max_tokens of them;
    L = the longest row. The text and lengths go to QwenImageTransformer(text, text_lens=...).
    """
    if hidden_states.dim() != 3 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValidationError(
            f"hidden_states {tuple(hidden_states.shape)} and attention_mask {tuple(attention_mask.shape)}: "
            "expected [B, T, D] and [B, T]"
        )
    valid = attention_mask.bool()
    rows = [
        states[keep][prefix_tokens:][:max_tokens] for states, keep in zip(hidden_states, valid, strict=True)
    ]
    text_lens = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    text = hidden_states.new_zeros(len(rows), int(text_lens.max()), hidden_states.shape[-1])
    for index, row in enumerate(rows):
        text[index, : row.shape[0]] = row
    return text, text_lens
