"""PromptEnhancer: rewrite a short prompt into a detailed one with the encoder-decoder engine.

A callable str -> str, usable as `prompt_enhancer=` by the pipelines. The prompt is wrapped in an
instruction and, by default, in Gemma's chat turns (what T5Gemma instruction-tuned checkpoints were
trained on); `template=RAW_TEMPLATE` feeds the prompt as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.errors import MmgenError, ValidationError
from mmgen.llm.engine import Engine, EngineConfig
from mmgen.llm.sampling import SamplingParams

DEFAULT_INSTRUCTION = (
    "Rewrite the following prompt for a text-to-video model as one detailed paragraph: describe the "
    "subject, the setting, the motion, the lighting and the camera. Reply with the rewritten prompt only.\n\n"
    "Prompt: {prompt}"
)
DEFAULT_TEMPLATE = "<start_of_turn>user\n" + DEFAULT_INSTRUCTION + "<end_of_turn>\n<start_of_turn>model\n"
RAW_TEMPLATE = "{prompt}"


class PromptEnhancer:
    """Engine-backed prompt rewriter; one engine serves every call (batched in enhance_batch)."""

    def __init__(
        self,
        engine: Engine,
        *,
        template: str = DEFAULT_TEMPLATE,
        params: SamplingParams | None = None,
    ):
        if "{prompt}" not in template:
            raise ValidationError("prompt enhancer template must contain '{prompt}'")
        if engine.tokenizer is None:
            raise ValidationError(
                "the prompt enhancer needs a tokenizer (tokenizer.json in the model directory)"
            )
        self.engine = engine
        self.template = template
        self.params = params or SamplingParams(max_new_tokens=256)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        engine_config: EngineConfig | None = None,
        template: str = DEFAULT_TEMPLATE,
        params: SamplingParams | None = None,
    ) -> PromptEnhancer:
        """Load an HF-format T5Gemma directory and wrap it."""
        engine = Engine.from_pretrained(directory, engine_config, dtype=dtype, device=device)
        return cls(engine, template=template, params=params)

    def enhance_batch(self, prompts: list[str]) -> list[str]:
        """Rewrite every prompt in one continuous batch -> texts in the same order."""
        inputs = [self.template.replace("{prompt}", p) for p in prompts]
        outputs = self.engine.generate(inputs, self.params)
        texts = []
        for prompt, out in zip(prompts, outputs, strict=True):
            if out.error is not None:
                raise MmgenError(f"prompt enhancer: {out.error}")
            text = (out.text or "").strip()
            if not text:
                raise MmgenError(f"prompt enhancer: the model produced no text for prompt {prompt!r}")
            texts.append(text)
        return texts

    def __call__(self, prompt: str) -> str:
        """prompt -> the rewritten prompt."""
        return self.enhance_batch([prompt])[0]
