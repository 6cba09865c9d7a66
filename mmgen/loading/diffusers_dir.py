"""Load a diffusers-format Wan directory (Wan2.1 T2V / I2V, Wan2.2 T2V-A14B / I2V-A14B / TI2V-5B).

Layout (as `WanPipeline` / `WanImageToVideoPipeline.save_pretrained` write it and the
Wan-AI/*-Diffusers repos ship it):

    model_index.json             _class_name, [library, class] per component, and the variant's
                                 values: boundary_ratio (two experts), expand_timesteps (TI2V)
    transformer/                 config.json + (sharded) diffusion_pytorch_model*.safetensors
    transformer_2/               optional: Wan2.2 A14B's low-noise expert (same layout)
    image_encoder/               optional: Wan2.1 I2V's CLIPVisionModel (config.json + model*.safetensors)
    image_processor/             with image_encoder: preprocessor_config.json (CLIPImageProcessor)
    text_encoder/                config.json (UMT5EncoderModel) + (sharded) model*.safetensors
    tokenizer/                   tokenizer.json (+ tokenizer_config.json / special_tokens_map.json)
    vae/                         config.json + diffusion_pytorch_model.safetensors (AutoencoderKLWan)
    scheduler/                   scheduler_config.json (UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler)
    mmgen_defaults.json          optional: generation defaults (GenerationDefaults); Wan2.1's when absent

The transformer and the text encoder are mmgen's own modules (meta-device init, weights allocated
once); the VAE and the scheduler are diffusers'. Any missing directory, file or tensor is a LoadError
naming it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError
from mmgen.loading.clip_vision import load_clip_vision, load_image_preprocess
from mmgen.loading.safetensors_dir import read_json
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.loading.umt5 import load_umt5_encoder
from mmgen.loading.wan_transformer import load_wan_transformer
from mmgen.models.clip_vision import ClipImagePreprocess, ClipVisionEncoder
from mmgen.models.umt5 import UMT5Encoder
from mmgen.models.wan import WanDiT
from mmgen.placement.tensors import PinnedStore

MODEL_INDEX = "model_index.json"
DEFAULTS_FILE = "mmgen_defaults.json"
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
# component -> classes model_index.json may name for it (None: any; the tokenizer is read from tokenizer.json).
COMPONENT_CLASSES: dict[str, tuple[str, ...] | None] = {
    "transformer": ("WanTransformer3DModel",),
    "text_encoder": ("UMT5EncoderModel",),
    "tokenizer": None,
    "vae": ("AutoencoderKLWan",),
    "scheduler": ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"),
}
# Components a variant may add (absent or [null, null] otherwise).
OPTIONAL_COMPONENT_CLASSES: dict[str, tuple[str, ...]] = {
    "transformer_2": ("WanTransformer3DModel",),
    "image_encoder": ("CLIPVisionModel", "CLIPVisionModelWithProjection"),
    # Read as the PIL-backed processor computes (the torchvision "fast" one resizes slightly differently).
    "image_processor": ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast"),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults of the pipeline arguments a caller leaves out; Wan2.1 T2V's unless the directory says.

    Stored as `mmgen_defaults.json` next to model_index.json (the embedded default model has one);
    every key is optional and an unknown key is an error.
    """

    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    negative_prompt: str = ""
    fps: int = 16
    # Why these values: where they came from (a file, the variant the checkpoint's configs name), for
    # the output manifest. Not a generation argument: mmgen_defaults.json cannot set it.
    chosen_by: str = dataclasses.field(default="set by the caller", compare=False)

    def __post_init__(self) -> None:
        for name in ("height", "width", "num_frames", "num_inference_steps", "fps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoadError(f"generation defaults: {name} = {value!r}, must be a positive integer")
        guidance = self.guidance_scale
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not guidance >= 0:
            raise LoadError(f"generation defaults: guidance_scale = {guidance!r}, must be a number >= 0")
        if not isinstance(self.negative_prompt, str):
            raise LoadError(
                f"generation defaults: negative_prompt = {self.negative_prompt!r}, must be a string"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: Path) -> GenerationDefaults:
        """From a mmgen_defaults.json dict; unknown keys and bad values raise a LoadError naming `source`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"chosen_by"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LoadError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        try:
            return cls(**data, chosen_by=str(source))
        except LoadError as err:
            raise LoadError(f"{source}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The generation arguments (what mmgen_defaults.json holds; chosen_by left out)."""
        values = dataclasses.asdict(self)
        del values["chosen_by"]
        return values


# What each variant's checkpoint was trained for (Wan2.1 / Wan2.2 model cards and generate configs:
# TI2V-5B 1280*704 x 121 frames at 24 fps; the A14B experts 1280*720 x 81 at 16 fps; Wan2.1 I2V
# ships a 480P and a 720P release). Applied when a directory has no mmgen_defaults.json.
WAN21_T2V_DEFAULTS = GenerationDefaults(
    chosen_by="mmgen's Wan2.1 T2V defaults (no mmgen_defaults.json, no variant mark): 480x832, 81 frames, 16 fps"
)
VARIANT_SIZES = {
    "ti2v": (704, 1280, 121, 24),
    "a14b": (720, 1280, 81, 16),
    "i2v-720p": (720, 1280, 81, 16),
    "i2v-480p": (480, 832, 81, 16),
}


def variant_generation_defaults(
    directory: Path, *, expand_timesteps: bool, two_experts: bool, image_encoder: bool
) -> GenerationDefaults:
    """The defaults of a directory without mmgen_defaults.json, from what its configs say it is.

    expand_timesteps (model_index.json): Wan2.2 TI2V-5B. boundary_ratio with transformer_2: Wan2.2
    A14B (T2V or I2V). An image_encoder: Wan2.1 I2V, whose 480P and 720P releases have identical
    configs: the only mark is the release name, so a path component naming 720P picks 720x1280 and
    anything else 480x832 (chosen_by says which and why).
    """
    if expand_timesteps:
        key, why = "ti2v", "Wan2.2 TI2V-5B (expand_timesteps in model_index.json)"
    elif two_experts:
        key, why = "a14b", "Wan2.2 A14B (two experts, boundary_ratio in model_index.json)"
    elif image_encoder:
        named = any("720p" in part.casefold() for part in Path(directory).resolve().parts)
        key = "i2v-720p" if named else "i2v-480p"
        why = (
            f"Wan2.1 I2V {'720P' if named else '480P'} (image_encoder in model_index.json; the path "
            f"{'names' if named else 'does not name'} 720P, the only mark telling the releases apart)"
        )
    else:
        return WAN21_T2V_DEFAULTS
    height, width, frames, fps = VARIANT_SIZES[key]
    return GenerationDefaults(
        height=height,
        width=width,
        num_frames=frames,
        fps=fps,
        chosen_by=f"{why}: trained at {height}x{width}, {frames} frames, {fps} fps",
    )


@dataclass(frozen=True, eq=False)
class WanComponents:
    """Everything a Wan pipeline is made of. `scheduler` is a template: pipelines copy it per call.

    The variant's parts and values: transformer_2 with boundary_ratio (Wan2.2 A14B: `transformer`
    serves t >= boundary_ratio * num_train_timesteps, `transformer_2` below), image_encoder with
    image_preprocess (Wan2.1 I2V), expand_timesteps (Wan2.2 TI2V).
    """

    transformer: WanDiT
    text_encoder: UMT5Encoder
    tokenizer: TextTokenizer
    vae: Any  # diffusers AutoencoderKLWan
    scheduler: Any  # diffusers UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler
    defaults: GenerationDefaults = WAN21_T2V_DEFAULTS
    source: Path | None = None
    transformer_2: WanDiT | None = None
    image_encoder: ClipVisionEncoder | None = None
    image_preprocess: ClipImagePreprocess | None = None
    boundary_ratio: float | None = None
    expand_timesteps: bool = False


def read_model_index(directory: Path) -> dict[str, Any]:
    """model_index.json of a Wan directory, checked: pipeline class, components, their classes, variant values."""
    directory = Path(directory)
    if directory.is_file():
        raise LoadError(f"{directory}: a file; expected a model directory (holding {MODEL_INDEX})")
    if not directory.is_dir():
        raise LoadError(f"{directory}: model directory not found")
    path = directory / MODEL_INDEX
    index = read_json(path)
    if index.get("_class_name") not in PIPELINE_CLASSES:
        raise LoadError(
            f"{path}: _class_name is {index.get('_class_name')!r}; supported: {', '.join(PIPELINE_CLASSES)}"
        )
    ratio = index.get("boundary_ratio")
    two = _is_set(index.get("transformer_2"))
    if two != (ratio is not None):
        raise LoadError(f"{path}: transformer_2 and boundary_ratio come together (Wan2.2 A14B); got one")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1
    ):
        raise LoadError(f"{path}: boundary_ratio = {ratio!r}, must be a number in (0, 1)")
    if not isinstance(index.get("expand_timesteps", False), bool):
        raise LoadError(f"{path}: expand_timesteps = {index['expand_timesteps']!r}, must be true or false")
    if _is_set(index.get("image_encoder")) != _is_set(index.get("image_processor")):
        raise LoadError(f"{path}: image_encoder and image_processor come together (Wan2.1 I2V); got one")
    present = {
        name: allowed for name, allowed in OPTIONAL_COMPONENT_CLASSES.items() if _is_set(index.get(name))
    }
    for component, allowed in {**COMPONENT_CLASSES, **present}.items():
        entry = index.get(component)
        if not _is_set(entry):
            raise LoadError(f"{path}: lacks the component {component!r}")
        if not (isinstance(entry, list) and len(entry) == 2):
            raise LoadError(f"{path}: {component} must be [library, class], got {entry!r}")
        if allowed is not None and entry[1] not in allowed:
            raise LoadError(
                f"{path}: {component} class {entry[1]!r} is not supported; allowed: {', '.join(allowed)}"
            )
        if not (directory / component).is_dir():
            raise LoadError(
                f"{directory / component}: component directory not found (listed in {MODEL_INDEX})"
            )
    return index


def read_generation_defaults(
    directory: Path, *, expand_timesteps: bool = False, two_experts: bool = False, image_encoder: bool = False
) -> GenerationDefaults:
    """The directory's mmgen_defaults.json; without one, the defaults of the variant its configs mark
    (variant_generation_defaults: Wan2.1 T2V's when no mark is set)."""
    path = Path(directory) / DEFAULTS_FILE
    if not path.exists():
        return variant_generation_defaults(
            directory, expand_timesteps=expand_timesteps, two_experts=two_experts, image_encoder=image_encoder
        )
    return GenerationDefaults.from_dict(read_json(path), source=path)


def load_scheduler(directory: Path, *, expected_class: str | None = None) -> Any:
    """A diffusers scheduler from `directory/scheduler_config.json`, its class chosen by `_class_name`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    classes = {cls.__name__: cls for cls in (UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler)}
    path = Path(directory) / "scheduler_config.json"
    config = read_json(path)
    name = config.get("_class_name")
    if name not in classes:
        raise LoadError(f"{path}: _class_name {name!r} is not supported; allowed: {', '.join(classes)}")
    if expected_class is not None and name != expected_class:
        raise LoadError(
            f"{path}: _class_name {name!r} differs from {MODEL_INDEX}'s scheduler {expected_class!r}"
        )
    try:
        return classes[name].from_config(config)
    except Exception as err:  # diffusers raises ValueError/TypeError for inconsistent configs
        raise LoadError(f"{path}: invalid {name} config ({_one_line(err)})") from err


def load_vae(directory: Path, *, dtype: torch.dtype, device: str | torch.device) -> Any:
    """diffusers AutoencoderKLWan from a local `vae/` directory, in `dtype` on `device`, eval mode."""
    from diffusers import AutoencoderKLWan

    directory = Path(directory)
    config = read_json(directory / "config.json")
    if config.get("_class_name", "AutoencoderKLWan") != "AutoencoderKLWan":
        raise LoadError(
            f"{directory / 'config.json'}: _class_name {config['_class_name']!r}, expected 'AutoencoderKLWan'"
        )
    weights = sorted(directory.glob("diffusion_pytorch_model*.safetensors"))
    if not weights:
        raise LoadError(f"{directory}: no diffusion_pytorch_model*.safetensors weight file")
    try:
        vae = AutoencoderKLWan.from_pretrained(str(directory), local_files_only=True, torch_dtype=dtype)
    except Exception as err:  # diffusers raises OSError/ValueError/RuntimeError with multi-line messages
        raise LoadError(f"{directory}: cannot load AutoencoderKLWan ({_one_line(err)})") from err
    return vae.to(device).eval()


def load_wan_components(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
) -> WanComponents:
    """All components of a diffusers-format Wan directory (or an original Wan2.2 A14B one, see
    mmgen.loading.original_dir); transformers, text and image encoders in `dtype`.

    The VAE defaults to float32, as Wan's reference code and diffusers' examples run it.
    host: a PinnedStore the transformers and the text encoder are read into (offload placements).
    """
    directory = Path(directory)
    if not (directory / MODEL_INDEX).exists():
        from mmgen.loading.original_dir import is_original_a14b, load_original_a14b

        if is_original_a14b(directory):  # the Wan2.2 A14B repository layout (high/low_noise_model/)
            return load_original_a14b(directory, dtype=dtype, device=device, vae_dtype=vae_dtype, host=host)
    index = read_model_index(directory)
    # The variant's marks (read_model_index checked them).
    two_experts = _is_set(index.get("transformer_2"))
    with_image = _is_set(index.get("image_encoder"))
    expand_timesteps = bool(index.get("expand_timesteps", False))
    defaults = read_generation_defaults(
        directory, expand_timesteps=expand_timesteps, two_experts=two_experts, image_encoder=with_image
    )
    # mmgen's own components first: their errors come before diffusers is even imported.
    transformer = load_wan_transformer(directory / "transformer", dtype=dtype, device=device, host=host)
    transformer_2 = None
    if two_experts:
        transformer_2 = load_wan_transformer(
            directory / "transformer_2", dtype=dtype, device=device, host=host
        )
    image_encoder = image_preprocess = None
    if with_image:
        image_encoder = load_clip_vision(directory / "image_encoder", dtype=dtype, device=device)
        image_preprocess = load_image_preprocess(directory / "image_processor")
    text_encoder = load_umt5_encoder(directory / "text_encoder", dtype=dtype, device=device, host=host)
    tokenizer = TextTokenizer.from_dir(directory / "tokenizer")
    scheduler = load_scheduler(directory / "scheduler", expected_class=index["scheduler"][1])
    vae = load_vae(directory / "vae", dtype=vae_dtype, device=device)
    components = WanComponents(
        transformer,
        text_encoder,
        tokenizer,
        vae,
        scheduler,
        defaults,
        directory,
        transformer_2=transformer_2,
        image_encoder=image_encoder,
        image_preprocess=image_preprocess,
        boundary_ratio=None if index.get("boundary_ratio") is None else float(index["boundary_ratio"]),
        expand_timesteps=expand_timesteps,
    )
    check_compatible(components)
    return components


def check_compatible(components: WanComponents) -> None:
    """Cross-component shape agreements a mismatched directory would otherwise break mid-generation."""
    source = components.source or Path("<components>")
    dit = components.transformer.config
    text = components.text_encoder.config
    vae = components.vae.config
    pairs = [
        ("transformer text_dim", dit.text_dim, "text_encoder d_model", text.d_model),
        ("transformer out_channels", dit.out_channels, "vae z_dim", vae.z_dim),
    ]
    if components.transformer_2 is not None:
        second = components.transformer_2.config
        for name in ("in_channels", "out_channels", "text_dim", "patch_size", "image_dim"):
            pairs.append(
                (f"transformer {name}", getattr(dit, name), f"transformer_2 {name}", getattr(second, name))
            )
    if components.image_encoder is not None:
        pairs.append(
            (
                "transformer image_dim",
                dit.image_dim,
                "image_encoder hidden_size",
                components.image_encoder.config.hidden_size,
            )
        )
    for left, left_value, right, right_value in pairs:
        if left_value != right_value:
            raise LoadError(f"{source}: {left} = {left_value} but {right} = {right_value}; they must match")
    # in_channels: the noise alone (T2V, TI2V) or noise + frame mask + image latents (I2V).
    allowed = (
        (vae.z_dim,)
        if components.expand_timesteps
        else (vae.z_dim, 2 * vae.z_dim + vae.scale_factor_temporal)
    )
    if dit.in_channels not in allowed:
        raise LoadError(
            f"{source}: transformer in_channels = {dit.in_channels}; with vae z_dim {vae.z_dim} it must be "
            f"{' or '.join(map(str, allowed))} (text-to-video{'' if components.expand_timesteps else ' or image-to-video'})"
        )
    if dit.image_dim is not None and components.image_encoder is None:
        raise LoadError(
            f"{source}: the transformer has an image path (image_dim) but there is no image_encoder"
        )
    if components.tokenizer.vocab_size > text.vocab_size:
        raise LoadError(
            f"{source}: tokenizer has {components.tokenizer.vocab_size} ids but text_encoder vocab_size is "
            f"{text.vocab_size}"
        )
    for name in ("latents_mean", "latents_std"):
        values = getattr(vae, name)
        if len(values) != vae.z_dim or not all(math.isfinite(v) for v in values):
            raise LoadError(f"{source}: vae {name} must hold {vae.z_dim} finite numbers, got {values!r}")


def _is_set(entry: Any) -> bool:
    # diffusers writes absent optional components as [null, null].
    return entry is not None and entry != [None, None]


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
