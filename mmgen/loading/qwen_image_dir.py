"""Load a diffusers-format Qwen-Image directory (local only; nothing is fetched).

Layout (Qwen/Qwen-Image as released, or diffusers' QwenImagePipeline.save_pretrained):

    model_index.json   _class_name QwenImagePipeline; its components and their classes
    transformer/       config.json + safetensors shards (QwenImageTransformer2DModel; mmgen's own model)
    text_encoder/      config.json + safetensors shards (Qwen2_5_VLForConditionalGeneration; transformers)
    tokenizer/         tokenizer.json, or vocab.json + merges.txt + tokenizer_config.json (Qwen2)
    vae/               config.json + weights (AutoencoderKLQwenImage; diffusers)
    scheduler/         scheduler_config.json (FlowMatchEulerDiscreteScheduler; diffusers)

The text encoder's config.json may be in transformers 4.x's flat form (the language model's fields at
the top level beside vision_config) or 5.x's (nested under text_config): the installed transformers
reads both (5.x moves flat fields into text_config; 4.x >= 4.52 reads text_config). Only its
language model is kept (see mmgen.models.qwen_image_text); the vision tower and LM head are freed.

A Qwen-Image-Edit directory (model_index.json's _class_name QwenImageEditPipeline, Qwen/Qwen-Image-Edit
or diffusers' QwenImageEditPipeline.save_pretrained) has the same parts and one more:

    processor/         preprocessor_config.json (Qwen2VLImageProcessor) + the tokenizer's files (Qwen2VLProcessor)

Its text encoder is the whole Qwen2.5-VL (the vision tower sees the input image), and the prompts are
tokenized with processor/'s tokenizer (what diffusers' processor encodes with), which must know
<|image_pad|> as one token whose id is the text encoder's image_token_id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError, one_line
from mmgen.loading.diffusers_dir import load_diffusers_model, load_scheduler
from mmgen.loading.qwen_image import load_qwen_image_transformer
from mmgen.loading.qwen_image_classes import EDIT_PIPELINE_CLASS, PIPELINE_CLASSES
from mmgen.loading.qwen_tokenizer import QwenTokenizer
from mmgen.loading.safetensors_dir import read_json
from mmgen.models.qwen_image import QwenImageTransformer
from mmgen.models.qwen_image_prompt import EDIT_TEMPLATE, IMAGE_PAD, template_prefix_tokens
from mmgen.models.qwen_image_text import QwenTextEncoder, QwenVisionTextEncoder, language_model_of
from mmgen.placement.tensors import PinnedStore

MODEL_INDEX = "model_index.json"
# component -> the classes model_index.json may name for it.
COMPONENT_CLASSES = (
    ("transformer", ("QwenImageTransformer2DModel",)),
    ("text_encoder", ("Qwen2_5_VLForConditionalGeneration",)),
    ("tokenizer", ("Qwen2Tokenizer", "Qwen2TokenizerFast")),
    ("vae", ("AutoencoderKLQwenImage",)),
    ("scheduler", ("FlowMatchEulerDiscreteScheduler",)),
)
EDIT_COMPONENT_CLASSES = (*COMPONENT_CLASSES, ("processor", ("Qwen2VLProcessor",)))
TEXT_ENCODER_MODEL_TYPE = "qwen2_5_vl"


@dataclass(frozen=True)
class QwenImageComponents:
    """The loaded parts of a Qwen-Image directory."""

    transformer: QwenImageTransformer
    text_encoder: QwenTextEncoder | QwenVisionTextEncoder  # the latter for Qwen-Image-Edit
    tokenizer: QwenTokenizer
    vae: Any  # diffusers AutoencoderKLQwenImage
    scheduler: Any  # diffusers FlowMatchEulerDiscreteScheduler
    source: Path | None = None
    image_processor: Any = None  # Qwen-Image-Edit: transformers' Qwen2VLImageProcessor of processor/


def qwen_pipeline_class(directory: Path | str) -> str | None:
    """The Qwen pipeline class model_index.json names (one of PIPELINE_CLASSES), else None."""
    path = Path(directory) / MODEL_INDEX
    if not path.is_file():
        return None
    try:
        name = read_json(path).get("_class_name")
    except LoadError:
        return None
    return name if name in PIPELINE_CLASSES else None


def is_qwen_image_dir(directory: Path | str) -> bool:
    """Whether `directory` has a model_index.json naming QwenImagePipeline or QwenImageEditPipeline
    (other files unchecked)."""
    return qwen_pipeline_class(directory) is not None


def read_qwen_model_index(directory: Path | str) -> dict[str, Any]:
    """model_index.json of a Qwen-Image (or -Edit) directory, checked: pipeline class, each component's
    class and folder."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: Qwen-Image model directory not found")
    path = directory / MODEL_INDEX
    index = read_json(path)
    if index.get("_class_name") not in PIPELINE_CLASSES:
        raise LoadError(
            f"{path}: _class_name is {index.get('_class_name')!r}; expected one of {', '.join(PIPELINE_CLASSES)}"
        )
    components = EDIT_COMPONENT_CLASSES if index["_class_name"] == EDIT_PIPELINE_CLASS else COMPONENT_CLASSES
    for component, allowed in components:
        entry = index.get(component)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] is not None):
            raise LoadError(f"{path}: {component} must be [library, class], got {entry!r}")
        if entry[1] not in allowed:
            raise LoadError(
                f"{path}: {component} class {entry[1]!r} is not supported; allowed: {', '.join(allowed)}"
            )
        if not (directory / component).is_dir():
            raise LoadError(
                f"{directory / component}: component directory not found (listed in {MODEL_INDEX})"
            )
    return index


def _transformers() -> Any:
    """The transformers module (Qwen-Image's text encoder and Edit's image processor run on it), an
    optional dependency: the `qwen` extra. Without it, one LoadError naming the extra."""
    try:
        import transformers
    except ImportError:
        raise LoadError(
            "Qwen-Image's text encoder (Qwen2.5-VL) runs on transformers, which is not installed: "
            'pip install -e ".[qwen]" (or pip install "mmgen[qwen]")'
        ) from None
    return transformers


def load_qwen_vl_model(
    directory: Path | str, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Any:
    """transformers' Qwen2_5_VLForConditionalGeneration from a local `text_encoder/` directory, in `dtype`
    on `device` (a LoadError names the directory). On a GPU transformers reads the checkpoint straight
    onto it (device_map): no whole host copy of the 7B model first, no pageable copy after."""
    transformers = _transformers()
    directory = Path(directory)
    config = read_json(directory / "config.json")
    if config.get("model_type") != TEXT_ENCODER_MODEL_TYPE:
        raise LoadError(
            f"{directory / 'config.json'}: model_type {config.get('model_type')!r}; expected "
            f"{TEXT_ENCODER_MODEL_TYPE!r} (Qwen2.5-VL)"
        )
    # transformers 5 names the argument dtype; 4.x torch_dtype.
    major = int(transformers.__version__.split(".")[0])
    dtype_kwarg = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
    if torch.device(device).type != "cpu":
        dtype_kwarg["device_map"] = {"": str(device)}
    try:
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(directory), local_files_only=True, **dtype_kwarg
        )
    except Exception as err:  # transformers raises OSError/ValueError/RuntimeError, often multi-line
        raise LoadError(
            f"{directory}: cannot load Qwen2_5_VLForConditionalGeneration ({one_line(err)})"
        ) from err
    return model


def load_qwen_text_encoder(
    directory: Path | str, *, tokenizer: QwenTokenizer, dtype: torch.dtype, device: str | torch.device
) -> QwenTextEncoder:
    """Qwen2.5-VL's language model from a local `text_encoder/` directory (transformers), in `dtype` on
    `device`, with the template prefix length the tokenizer gives."""
    language_model = language_model_of(load_qwen_vl_model(directory, dtype=dtype, device=device)).to(device)
    _check_vocabulary(directory, language_model, tokenizer)
    return QwenTextEncoder(language_model, prefix_tokens=template_prefix_tokens(tokenizer.count))


def load_qwen_vision_text_encoder(
    directory: Path | str, *, tokenizer: QwenTokenizer, dtype: torch.dtype, device: str | torch.device
) -> QwenVisionTextEncoder:
    """The whole Qwen2.5-VL (vision tower included) from a local `text_encoder/` directory, in `dtype` on
    `device`, for Qwen-Image-Edit: the tokenizer's <|image_pad|> id must be the model's image_token_id."""
    model = load_qwen_vl_model(directory, dtype=dtype, device=device)
    _check_vocabulary(directory, language_model_of(model), tokenizer)
    pad_ids = tokenizer.encode(IMAGE_PAD)
    image_token_id = getattr(model.config, "image_token_id", None)
    if pad_ids != [image_token_id]:
        raise LoadError(
            f"{directory}: the tokenizer encodes {IMAGE_PAD} as {pad_ids}; the text encoder's image_token_id is "
            f"{image_token_id} (the processor's tokenizer must be Qwen2.5-VL's)"
        )
    prefix = template_prefix_tokens(tokenizer.count, EDIT_TEMPLATE)
    return QwenVisionTextEncoder(model.to(device), prefix_tokens=prefix)


def load_qwen_image_processor(directory: Path | str) -> Any:
    """transformers' Qwen2-VL image processor of a local `processor/` directory (preprocessor_config.json),
    the class transformers' Qwen2VLProcessor.from_pretrained picks for it."""
    transformers = _transformers()
    directory = Path(directory)
    read_json(directory / "preprocessor_config.json")  # a LoadError names a missing or broken file
    try:
        return transformers.AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises OSError/ValueError with multi-line messages
        raise LoadError(f"{directory}: cannot load the Qwen2-VL image processor ({one_line(err)})") from err


def _check_vocabulary(directory: Path | str, language_model: Any, tokenizer: QwenTokenizer) -> None:
    rows = language_model.embed_tokens.weight.shape[0]
    if rows < tokenizer.vocab_size:
        raise LoadError(
            f"{directory}: the text encoder's {rows} embeddings do not cover the tokenizer's "
            f"{tokenizer.vocab_size} ids"
        )


def load_qwen_vae(directory: Path | str, *, dtype: torch.dtype, device: str | torch.device) -> Any:
    """diffusers AutoencoderKLQwenImage from a local `vae/` directory, in `dtype` on `device`, eval mode."""
    from diffusers import AutoencoderKLQwenImage  # diffusers >= 0.35 only (the project needs 0.33)

    vae = load_diffusers_model(AutoencoderKLQwenImage, Path(directory), dtype)
    return vae.to(device).eval().requires_grad_(False)


def load_qwen_image_components(
    directory: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
) -> QwenImageComponents:
    """Every component of a local diffusers-format Qwen-Image directory; transformer and text encoder in
    `dtype`, the VAE in `vae_dtype`, all on `device`. host: a PinnedStore the transformer's weights
    are read into (an offload placement adopts those buffers: no second host copy of the 20B model)."""
    directory = Path(directory)
    index = read_qwen_model_index(directory)
    edit = index["_class_name"] == EDIT_PIPELINE_CLASS
    tokenizer = QwenTokenizer.from_dir(directory / ("processor" if edit else "tokenizer"))
    load_encoder = load_qwen_vision_text_encoder if edit else load_qwen_text_encoder
    return QwenImageComponents(
        transformer=load_qwen_image_transformer(
            directory / "transformer", dtype=dtype, device=device, host=host
        ),
        text_encoder=load_encoder(
            directory / "text_encoder", tokenizer=tokenizer, dtype=dtype, device=device
        ),
        tokenizer=tokenizer,
        vae=load_qwen_vae(directory / "vae", dtype=vae_dtype, device=device),
        scheduler=load_scheduler(directory / "scheduler", expected_class=index["scheduler"][1]),
        source=directory,
        image_processor=load_qwen_image_processor(directory / "processor") if edit else None,
    )
