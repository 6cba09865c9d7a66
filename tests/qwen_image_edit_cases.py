"""A tiny Qwen-Image-Edit directory written offline, and diffusers' QwenImageEditPipeline over it.

The parts are qwen_image_cases' (transformer, VAE, scheduler) with a Qwen2.5-VL whose vision tower
is used: its image/vision token ids are those of the tiny tokenizer's vision tokens, and the
processor/ folder holds Qwen2-VL's image processor with small min/max pixels (the resized input image
becomes at most 4 x 4 merged vision tokens) beside the tokenizer's files, as Qwen's release lays it.

transformers' Qwen2VLProcessor checks the class of each part, its video processor too, even when
none is given; without torchvision that class does not exist and the check fails (an AttributeError
inside transformers). ReferenceProcessor skips the check for absent parts only; everything the
processor computes is transformers' own code. diffusers' save_pretrained cannot save it either, so
the directory is saved without a processor and processor/ is written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from qwen_image_cases import (
    SCHEDULER,
    SPECIALS,
    TINY_TRANSFORMER,
    VISION_SPECIALS,
    hf_tokenizer,
    tiny_text_encoder,
    tiny_transformer,
    tiny_vae,
    write_tokenizer,
)

EDIT_SPECIALS = (*SPECIALS, *VISION_SPECIALS)
MIN_PIXELS = 28 * 28 * 4  # one merged vision token
MAX_PIXELS = 112 * 112  # 4 x 4 merged vision tokens


class ReferenceProcessor(transformers.Qwen2VLProcessor):
    """transformers' Qwen2VLProcessor with no video processor (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def tiny_image_processor() -> Any:
    return transformers.Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def write_qwen_image_edit_dir(directory: Path) -> Path:
    """A diffusers-format Qwen-Image-Edit directory of tiny random parts (diffusers' save_pretrained),
    tokenizer/ and processor/ holding vocab.json + merges.txt (as Qwen's release)."""
    import diffusers

    tokenizer_dir = directory / "tokenizer_source"
    write_tokenizer(tokenizer_dir, EDIT_SPECIALS)
    tokenizer = hf_tokenizer(tokenizer_dir)
    ids = {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
        for name in ("image_pad", "video_pad", "vision_start", "vision_end")
    }
    token_ids = {
        "image_token_id": ids["image_pad_token_id"],
        "video_token_id": ids["video_pad_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "vision_end_token_id": ids["vision_end_token_id"],
    }
    pipe = diffusers.QwenImageEditPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer), TINY_TRANSFORMER["joint_attention_dim"], **token_ids),
        tokenizer=tokenizer,
        processor=None,
        transformer=tiny_transformer(),
    )
    target = directory / "qwen-image-edit"
    pipe.save_pretrained(str(target))
    (target / "tokenizer" / "tokenizer.json").unlink(missing_ok=True)  # Qwen's layout
    write_tokenizer(target / "tokenizer", EDIT_SPECIALS)
    tiny_image_processor().save_pretrained(str(target / "processor"))
    write_tokenizer(target / "processor", EDIT_SPECIALS)
    index_path = target / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2))
    return target


def reference_pipeline(directory: Path) -> Any:
    """diffusers' QwenImageEditPipeline loaded from `directory`, with transformers' processor of processor/."""
    import diffusers

    processor = ReferenceProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(str(directory / "processor")),
        tokenizer=hf_tokenizer(directory / "processor"),
    )
    pipe = diffusers.QwenImageEditPipeline.from_pretrained(
        str(directory), processor=processor, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
