"""Qwen-Image's text encoder: Qwen2.5-VL's language model run once over each templated prompt.

Qwen-Image conditions on the last hidden states (after the final norm) of Qwen2.5-VL-7B's language
model over the prompt in its chat template, the template's prefix dropped (qwen_image_prompt). This
is a prefill-only use: one forward per prompt, no KV cache, no generation.

Why transformers' module (Qwen2_5_VLTextModel) and not mmgen's LLM runtime (mmgen.llm): that
runtime serves T5Gemma, an encoder-decoder with sliding-window layers, softcapping and
cross-attention; it has no Qwen2.5 decoder stack (GQA with q/k/v biases, M-RoPE, SwiGLU, RMSNorm)
and its value is the paged KV cache, which a prefill that is thrown away after one forward does not
use. Adding a Qwen2.5 stack there is the path to running the encoder on FA3/FlashInfer; until then
the encoder is transformers' code with its weights, and this wrapper fixes what it is called with.
For text-only input Qwen2.5-VL's M-RoPE positions are plain 1-D positions on all three axes
(0..T-1 for an unpadded prompt), which is what the language model uses without position ids.

Each prompt runs alone, unpadded (as diffusers' QwenImagePipeline encodes a request's prompt and
negative prompt: two calls of batch 1), so no padding ever enters the encoder.

Qwen-Image-Edit's encoder (QwenVisionTextEncoder) is the whole Qwen2.5-VL: the vision tower turns
the input image's patches into the states of the prompt's <|image_pad|> tokens, and the language
model runs with Qwen2.5-VL's 3-D M-RoPE positions for them (transformers computes both from the
ids and image_grid_thw, as diffusers' QwenImageEditPipeline calls it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.models.qwen_image_prompt import (
    EDIT_TEMPLATE,
    MAX_TEXT_TOKENS,
    TEMPLATE_PREFIX_TOKENS,
    drop_template_prefix,
)


def language_model_of(model: Any) -> Any:
    """The language model of a transformers Qwen2_5_VLForConditionalGeneration: `.model.language_model`
    (transformers >= 4.52 and 5.x) or `.model` (earlier 4.x, where it was the text decoder itself)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


class QwenTextEncoder:
    """Token ids of templated prompts -> Qwen-Image's text states and per-prompt lengths.

    language_model: transformers' Qwen2.5-VL text model (see language_model_of); prefix_tokens: the
    template's tokens before the prompt under the tokenizer in use (34 for Qwen's).
    """

    def __init__(self, language_model: Any, *, prefix_tokens: int = TEMPLATE_PREFIX_TOKENS) -> None:
        if not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValidationError(f"prefix_tokens = {prefix_tokens!r}: must be an integer >= 0")
        self.language_model = language_model.eval().requires_grad_(False)
        self.prefix_tokens = prefix_tokens

    @property
    def module(self) -> Any:
        """The module holding the weights (what a placement moves): the language model."""
        return self.language_model

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def hidden_size(self) -> int:
        return self.language_model.embed_tokens.weight.shape[1]

    @torch.no_grad()
    def states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """One prompt's ids (template included) -> its last hidden states [T, hidden] in the model dtype."""
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
        if ids.shape[1] <= self.prefix_tokens:
            raise ValidationError(
                f"a templated prompt of {ids.shape[1]} tokens: expected more than the {self.prefix_tokens} "
                "template prefix tokens"
            )
        # The all-ones mask diffusers passes: the same attention path, so the same bits.
        mask = torch.ones_like(ids)
        output = self.language_model(input_ids=ids, attention_mask=mask, use_cache=False)
        return output.last_hidden_state[0]

    @torch.no_grad()
    def encode(
        self, prompts_ids: Sequence[Sequence[int]], *, max_tokens: int = MAX_TEXT_TOKENS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each templated prompt's ids -> text [B, L, hidden] (each prompt's states from column 0, zeros
        after; model dtype, model device) and text_lens int64 [B] on the CPU: the states less the
        template prefix, at most max_tokens of them (diffusers' max_sequence_length cut)."""
        if isinstance(prompts_ids, (str, bytes)) or len(prompts_ids) == 0:
            raise ValidationError("prompts_ids must be a non-empty sequence of token id sequences")
        return stack_prompt_states(
            (self.states(ids) for ids in prompts_ids), prefix_tokens=self.prefix_tokens, max_tokens=max_tokens
        )


def stack_prompt_states(
    states: Iterable[torch.Tensor], *, prefix_tokens: int, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's states [T_b, hidden] -> text [B, L, hidden] (each less its template prefix, at
    most max_tokens, from column 0, zeros after) and text_lens int64 [B] on the CPU."""
    rows = []
    for row in states:
        mask = torch.ones(1, row.shape[0], dtype=torch.int64, device=row.device)
        text, _ = drop_template_prefix(row[None], mask, prefix_tokens=prefix_tokens, max_tokens=max_tokens)
        rows.append(text[0])
    text_lens = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    text = rows[0].new_zeros(len(rows), int(text_lens.max()), rows[0].shape[-1])
    for index, row in enumerate(rows):
        text[index, : row.shape[0]] = row
    return text, text_lens


class QwenVisionTextEncoder(QwenTextEncoder):
    """Qwen-Image-Edit's encoder: templated prompts with the input image -> text states and lengths.

    model: transformers' Qwen2_5_VLForConditionalGeneration (vision tower and language model);
    prefix_tokens: the Edit template's dropped prefix under the tokenizer in use (64 for Qwen's).
    The weights' dtype, device and width are read as for T2I; `states` and `encode` take the image too.
    """

    def __init__(self, model: Any, *, prefix_tokens: int = EDIT_TEMPLATE.prefix_tokens) -> None:
        super().__init__(language_model_of(model), prefix_tokens=prefix_tokens)
        self.model = model.eval().requires_grad_(False)

    @property
    def module(self) -> Any:
        """The module holding the weights (what a placement moves): the whole Qwen2.5-VL."""
        return self.model

    @torch.no_grad()
    def states(
        self, token_ids: Sequence[int], pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """One prompt's ids (template and image pads included), the image's patches [P, C * 2 * 14 * 14]
        and grid int64 [1, 3] (Qwen2-VL's image processor) -> last hidden states [T, hidden]."""
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
        if ids.shape[1] <= self.prefix_tokens:
            raise ValidationError(
                f"a templated prompt of {ids.shape[1]} tokens: expected more than the {self.prefix_tokens} "
                "template prefix tokens"
            )
        output = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixel_values.to(self.device, self.dtype),
            image_grid_thw=image_grid_thw.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        return output.hidden_states[-1][0]

    @torch.no_grad()
    def encode(
        self,
        prompts_ids: Sequence[Sequence[int]],
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        *,
        max_tokens: int = MAX_TEXT_TOKENS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As QwenTextEncoder.encode, every prompt with the same image (pixel_values, image_grid_thw)."""
        if isinstance(prompts_ids, (str, bytes)) or len(prompts_ids) == 0:
            raise ValidationError("prompts_ids must be a non-empty sequence of token id sequences")
        return stack_prompt_states(
            (self.states(ids, pixel_values, image_grid_thw) for ids in prompts_ids),
            prefix_tokens=self.prefix_tokens,
            max_tokens=max_tokens,
        )
