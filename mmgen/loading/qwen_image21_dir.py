"""Load a diffusers-format Qwen-Image-2.1 directory (local only; nothing is fetched).

Layout (diffusers' QwenImage21Pipeline):

    model_index.json   _class_name QwenImage21Pipeline; its components and classes; sample_sigmas
    transformer/       config.json + safetensors shards (QwenImage21Transformer2DModel; mmgen's own model)
    text_encoder/      config.json + safetensors shards (Qwen3VLForConditionalGeneration; transformers)
    processor/         preprocessor_config.json, the tokenizer's files, the chat template (Qwen3VLProcessor)
    vae/               config.json + weights (AutoencoderKLQwenImage21; diffusers)
    scheduler/         scheduler_config.json (FlowMatchEulerDiscreteScheduler; diffusers)

The processor is built from its parts (image processor, tokenizer, chat template) as an image-only
Qwen3VLProcessor: mmgen never passes videos, and transformers' video processor needs torchvision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError, one_line
from mmgen.loading.diffusers_dir import load_diffusers_model, load_scheduler
from mmgen.loading.qwen_image21 import load_qwen_image21_transformer
from mmgen.loading.qwen_image_dir import load_qwen_image_processor
from mmgen.loading.safetensors_dir import Reads, checkpoint_bytes, find_weight_files, read_json
from mmgen.models.qwen_image21 import QwenImage21Transformer
from mmgen.placement.tensors import PinnedStore

MODEL_INDEX = "model_index.json"
PIPELINE_CLASS = "QwenImage21Pipeline"
COMPONENT_CLASSES = (
    ("transformer", ("QwenImage21Transformer2DModel",)),
    ("text_encoder", ("Qwen3VLForConditionalGeneration",)),
    ("processor", ("Qwen3VLProcessor",)),
    ("vae", ("AutoencoderKLQwenImage21",)),
    ("scheduler", ("FlowMatchEulerDiscreteScheduler",)),
)


@dataclass(frozen=True)
class QwenImage21Components:
    """The loaded parts of a Qwen-Image-2.1 directory."""

    transformer: QwenImage21Transformer
    text_encoder: Any  # transformers' Qwen3VLForConditionalGeneration; None where not loaded (text_weights)
    processor: Any  # transformers' Qwen3VLProcessor (images only)
    vae: Any  # diffusers' AutoencoderKLQwenImage21
    scheduler: Any  # diffusers' FlowMatchEulerDiscreteScheduler
    sample_sigmas: tuple[float, ...] | None
    source: Path


def is_qwen_image21_dir(directory: Path | str) -> bool:
    """Whether `directory` has a model_index.json naming QwenImage21Pipeline (other files unchecked)."""
    path = Path(directory) / MODEL_INDEX
    try:
        return path.is_file() and read_json(path).get("_class_name") == PIPELINE_CLASS
    except LoadError:
        return False


def read_model_index(directory: Path) -> dict[str, Any]:
    """model_index.json, checked: the pipeline class, each component's class and folder."""
    path = directory / MODEL_INDEX
    index = read_json(path)
    if index.get("_class_name") != PIPELINE_CLASS:
        raise LoadError(f"{path}: _class_name is {index.get('_class_name')!r}; expected {PIPELINE_CLASS}")
    for component, allowed in COMPONENT_CLASSES:
        entry = index.get(component)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in allowed):
            raise LoadError(
                f"{path}: {component} must be [library, one of {', '.join(allowed)}], got {entry!r}"
            )
        if not (directory / component).is_dir():
            raise LoadError(
                f"{directory / component}: component directory not found (listed in {MODEL_INDEX})"
            )
    return index


def load_processor(directory: Path) -> Any:
    """An image-only Qwen3VLProcessor from `processor/`: its image processor, tokenizer and chat template."""
    import transformers

    class ImageOnlyProcessor(transformers.Qwen3VLProcessor):
        """Qwen3VLProcessor without a video processor (whose class needs torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return (
                None if argument is None else super().check_argument_for_proper_class(argument_name, argument)
            )

    template = _chat_template(directory)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises OSError/ValueError with multi-line messages
        raise LoadError(f"{directory}: cannot load the tokenizer ({one_line(err)})") from err
    return ImageOnlyProcessor(
        image_processor=load_qwen_image_processor(directory), tokenizer=tokenizer, chat_template=template
    )


def _chat_template(directory: Path) -> str:
    """The processor's chat template: chat_template.jinja, else chat_template.json's entry."""
    jinja, json_file = directory / "chat_template.jinja", directory / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if json_file.is_file():
        return read_json(json_file)["chat_template"]
    raise LoadError(
        f"{directory}: no chat_template.jinja or chat_template.json (the system prefix comes from it)"
    )


def load_text_encoder(directory: Path, *, dtype: torch.dtype, device: str | torch.device) -> Any:
    import transformers

    try:
        model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
            str(directory), local_files_only=True, dtype=dtype
        )
    except Exception as err:  # transformers raises OSError/ValueError/RuntimeError, often multi-line
        raise LoadError(
            f"{directory}: cannot load Qwen3VLForConditionalGeneration ({one_line(err)})"
        ) from err
    return model.to(device).eval().requires_grad_(False)


def load_vae(directory: Path, *, dtype: torch.dtype, device: str | torch.device) -> Any:
    from diffusers import AutoencoderKLQwenImage21

    vae = load_diffusers_model(AutoencoderKLQwenImage21, Path(directory), dtype, check_class=False)
    return vae.to(device).eval().requires_grad_(False)


def qwen_image21_read_bytes(directory: Path) -> dict[str, int]:
    """{component: its checkpoint's bytes} a world's ranks can read in parts (load_qwen_image21_components'
    `reads`; mmgen.parallel.share.split_reads): the transformer (transformers' loader reads the text
    encoder whole)."""
    return {"transformer": checkpoint_bytes(find_weight_files(Path(directory) / "transformer"))}


def load_qwen_image21_components(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
    text_weights: bool = True,
    reads: Mapping[str, Reads] | None = None,
) -> QwenImage21Components:
    """Every component of a local diffusers-format Qwen-Image-2.1 directory: transformer and text encoder
    in `dtype`, the VAE in `vae_dtype`, all on `device`. host: a PinnedStore the transformer's weights
    are read into (an offload placement adopts those buffers: no second host copy). text_weights: False =
    no text encoder (None; its directory still checked): a rank whose text comes from the rank that
    encodes (mmgen.parallel.share.reads_for_world); nothing else reads the encoder. reads: {"transformer":
    what of it this process reads (load_into_module's `read`)}, the rest allocated on `device`: a rank's
    part (mmgen.parallel.share.SplitReads), share_reads sending the rest; else read whole."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Qwen-Image-2.1 model directory not found")
    index = read_model_index(directory)
    sigmas = index.get("sample_sigmas")
    return QwenImage21Components(
        transformer=load_qwen_image21_transformer(
            directory / "transformer",
            dtype=dtype,
            device=device,
            host=host,
            read=(reads or {}).get("transformer", True),
        ),
        text_encoder=load_text_encoder(directory / "text_encoder", dtype=dtype, device=device)
        if text_weights
        else None,
        processor=load_processor(directory / "processor"),
        vae=load_vae(directory / "vae", dtype=vae_dtype, device=device),
        scheduler=load_scheduler(directory / "scheduler", expected_class=index["scheduler"][1]),
        sample_sigmas=None if sigmas is None else tuple(float(s) for s in sigmas),
        source=directory,
    )
