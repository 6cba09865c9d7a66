"""Tiny random Qwen-Image-2.1 parts made offline, and diffusers' QwenImage21Pipeline over them.

The tokenizer is qwen_image_cases' byte-level BPE with Qwen's chat and vision tokens; the processor is
transformers' Qwen3VLProcessor over it with Qwen2-VL's image processor at Qwen3-VL's patch size 16
(small min/max pixels: a condition image becomes a few merged vision tokens) and a chat template that
renders a system message as Qwen's does (diffusers derives the dropped prefix from it). Without
torchvision transformers' video processor class does not exist, so ReferenceProcessor skips the class
check of absent parts only (as qwen_image_edit_cases does for Qwen2-VL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from qwen_image21_cases import randomize
from qwen_image_cases import SCHEDULER, SPECIALS, VISION_SPECIALS, hf_tokenizer, write_tokenizer

SPECIALS21 = (*SPECIALS, *VISION_SPECIALS)
TEXT_HIDDEN = 32
TINY21_TRANSFORMER = {
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "context_in_dim": TEXT_HIDDEN,
    "mlp_ratio": 3,
    "axes_dims_rope": (8, 12, 12),
}
TINY21_VAE = {
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True],
    "latents_mean": [0.1 * (i % 5) - 0.2 for i in range(16)],
    "latents_std": [1.0 + 0.1 * (i % 4) for i in range(16)],
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
)
MIN_PIXELS = 32 * 32 * 2  # a few merged 32 x 32 vision tokens
MAX_PIXELS = 96 * 96


class ReferenceProcessor(transformers.Qwen3VLProcessor):
    """transformers' Qwen3VLProcessor with no video processor (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def tiny_processor(directory: Path, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Any:
    """The processor over the tiny tokenizer (written to `directory`); an image is resized to hold between
    min_pixels and max_pixels (benchmarks pass Qwen3-VL's own bounds)."""
    write_tokenizer(directory, SPECIALS21)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return ReferenceProcessor(
        image_processor=image_processor, tokenizer=hf_tokenizer(directory), chat_template=CHAT_TEMPLATE
    )


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """Qwen3VLConfig's image / video / vision start and end token ids, as `tokenizer` numbers them."""
    names = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in names.items()}


def tiny_text_encoder(tokenizer: Any) -> Any:
    """A random two-layer Qwen3VLForConditionalGeneration (float32, eval) whose vision ids are the tokenizer's."""
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    }
    vision = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "patch_size": 16,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **vision_token_ids(tokenizer))
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(config).eval()


def tiny_parts(directory: Path) -> dict[str, Any]:
    """The pipeline's parts: scheduler, vae, text_encoder, processor, transformer (diffusers / transformers)."""
    import diffusers

    processor = tiny_processor(directory / "tokenizer")
    torch.manual_seed(1)
    transformer = randomize(diffusers.QwenImage21Transformer2DModel(**TINY21_TRANSFORMER), seed=4).eval()
    torch.manual_seed(2)
    vae = diffusers.AutoencoderKLQwenImage21(**TINY21_VAE).eval()
    return {
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        "vae": vae,
        "text_encoder": tiny_text_encoder(processor.tokenizer),
        "processor": processor,
        "transformer": transformer,
    }


def reference_pipeline(parts: dict[str, Any]) -> Any:
    import diffusers

    pipe = diffusers.QwenImage21Pipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_qwen_image21_dir(directory: Path, parts: dict[str, Any], sample_sigmas: list[float] | None) -> Path:
    """A diffusers-format directory of the parts, written part by part: diffusers' save_pretrained cannot
    save a processor without a video processor (module docstring), so processor/ is its parts' files."""
    import json

    target = directory / "qwen-image-2.1"
    for name in ("transformer", "text_encoder", "vae", "scheduler"):
        parts[name].save_pretrained(str(target / name))
    processor = parts["processor"]
    processor.image_processor.save_pretrained(str(target / "processor"))
    processor.tokenizer.save_pretrained(str(target / "processor"))
    (target / "processor" / "chat_template.jinja").write_text(processor.chat_template)
    index = {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "sample_sigmas": sample_sigmas,
    }
    (target / "model_index.json").write_text(json.dumps(index, indent=2))
    return target


def family_pipeline(parts: dict[str, Any], condition_resolution: int) -> Any:
    """mmgen's Qwen-Image-2.1 family pipeline over the tiny parts (its own transformer holding the
    reference transformer's weights; a fresh scheduler of the same config)."""
    from types import SimpleNamespace

    from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
    from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

    transformer = QwenImage21Transformer(QwenImage21Config.from_diffusers(dict(parts["transformer"].config)))
    transformer.load_state_dict(parts["transformer"].state_dict())
    components = SimpleNamespace(
        transformer=transformer.eval(),
        text_encoder=parts["text_encoder"],
        processor=parts["processor"],
        vae=parts["vae"],
        scheduler=type(parts["scheduler"]).from_config(parts["scheduler"].config),
        sample_sigmas=None,
        source=None,
    )
    return QwenImage21FamilyPipeline(components, condition_resolution=condition_resolution)
