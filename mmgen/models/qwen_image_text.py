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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.models.qwen_image_prompt import MAX_TEXT_TOKENS, TEMPLATE_PREFIX_TOKENS, drop_template_prefix


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
        rows = []
        for ids in prompts_ids:
            states = self.states(ids)
            mask = torch.ones(1, states.shape[0], dtype=torch.int64, device=states.device)
            text, _ = drop_template_prefix(
                states[None], mask, prefix_tokens=self.prefix_tokens, max_tokens=max_tokens
            )
            rows.append(text[0])
        text_lens = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
        text = rows[0].new_zeros(len(rows), int(text_lens.max()), rows[0].shape[-1])
        for index, row in enumerate(rows):
            text[index, : row.shape[0]] = row
        return text, text_lens
