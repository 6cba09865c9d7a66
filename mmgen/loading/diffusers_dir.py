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
    mmgen_defaults.json          optional: generation defaults (wan_components.GenerationDefaults); Wan2.1's when absent

The transformer and the text encoder are mmgen's own modules (meta-device init, weights allocated
once). The scheduler is mmgen's flow UniPC where the config is one (mmgen.schedulers.unipc_flow), else
diffusers'; the VAE of a text-to-video checkpoint is mmgen's Wan2.1 decoder (mmgen.models.wan_vae),
diffusers' AutoencoderKLWan where the pipeline encodes (I2V, TI2V, VACE) or the VAE is Wan2.2's. Both
of mmgen's compute diffusers' ops in diffusers' order: the same frames, without its ~2 s import. Any
missing directory, file or tensor is a LoadError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError, one_line
from mmgen.loading.clip_vision import load_clip_vision, load_image_preprocess
from mmgen.loading.original_dir import (
    HIGH_NOISE,
    LOW_NOISE,
    is_original_a14b,
    is_original_wan21,
    load_original_a14b,
    load_original_wan21,
)
from mmgen.loading.safetensors_dir import Reads, checkpoint_bytes, find_weight_files, read_json
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.loading.umt5 import load_umt5_encoder, umt5_bytes
from mmgen.loading.wan_components import WanComponents, check_compatible, read_generation_defaults
from mmgen.loading.wan_transformer import load_wan_transformer
from mmgen.loading.wan_vace import load_wan_dit
from mmgen.loading.wan_vae import load_wan_vae_decoder
from mmgen.models import wan_vae
from mmgen.models.wan import WanConfig
from mmgen.placement.tensors import PinnedStore
from mmgen.schedulers import unipc_flow

MODEL_INDEX = "model_index.json"
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline")
SCHEDULER_CLASSES = ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler")
VAE_CLASS = "AutoencoderKLWan"
# component -> classes model_index.json may name for it (None: any; the tokenizer is read from tokenizer.json).
COMPONENT_CLASSES: dict[str, tuple[str, ...] | None] = {
    "transformer": ("WanTransformer3DModel", "WanVACETransformer3DModel"),
    "text_encoder": ("UMT5EncoderModel",),
    "tokenizer": None,
    "vae": ("AutoencoderKLWan",),
    "scheduler": SCHEDULER_CLASSES,
}
# Components a variant may add (absent or [null, null] otherwise).
OPTIONAL_COMPONENT_CLASSES: dict[str, tuple[str, ...]] = {
    "transformer_2": ("WanTransformer3DModel",),
    "image_encoder": ("CLIPVisionModel", "CLIPVisionModelWithProjection"),
    # Read as the PIL-backed processor computes (the torchvision "fast" one resizes slightly differently).
    "image_processor": ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast"),
}


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


def load_scheduler(directory: Path, *, expected_class: str | None = None) -> Any:
    """The scheduler of `directory/scheduler_config.json`, its class chosen by `_class_name`: mmgen's
    FlowUniPCScheduler for the flow UniPC configs it computes (Wan's), else diffusers' class."""
    path = Path(directory) / "scheduler_config.json"
    config = read_json(path)
    name = config.get("_class_name")
    if name not in SCHEDULER_CLASSES:
        raise LoadError(
            f"{path}: _class_name {name!r} is not supported; allowed: {', '.join(SCHEDULER_CLASSES)}"
        )
    if expected_class is not None and name != expected_class:
        raise LoadError(
            f"{path}: _class_name {name!r} differs from {MODEL_INDEX}'s scheduler {expected_class!r}"
        )
    if unipc_flow.fits(config):  # no diffusers import (~2 s) for Wan's scheduler
        return unipc_flow.FlowUniPCScheduler.from_config(config)
    # diffusers takes ~2 s to import: kept off the request checks' path
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    classes = {cls.__name__: cls for cls in (UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler)}
    try:
        return classes[name].from_config(config)
    except Exception as err:  # diffusers raises ValueError/TypeError for inconsistent configs
        raise LoadError(f"{path}: invalid {name} config ({one_line(err)})") from err


def load_vae(
    directory: Path, *, dtype: torch.dtype, device: str | torch.device, decode_only: bool = False
) -> Any:
    """The AutoencoderKLWan of a local `vae/` directory, in `dtype` on `device`, eval mode.

    decode_only (the pipeline never encodes: text-to-video): mmgen's own Wan2.1 decoder where the
    config is that layout (mmgen.models.wan_vae: no diffusers import, the same frames); otherwise
    diffusers' AutoencoderKLWan (encoders, the Wan2.2 TI2V VAE).
    """
    directory = Path(directory)
    check_class_name(directory, VAE_CLASS)
    if not sorted(directory.glob("diffusion_pytorch_model*.safetensors")):
        raise LoadError(f"{directory}: no diffusion_pytorch_model*.safetensors weight file")
    config = read_json(directory / "config.json")
    if decode_only and wan_vae.fits(config):
        return load_wan_vae_decoder(directory, wan_vae.read_config(config), dtype=dtype, device=device)
    # diffusers takes ~2 s to import: kept off the request checks' path
    from diffusers import AutoencoderKLWan

    return load_diffusers_model(AutoencoderKLWan, directory, dtype, check_class=False).to(device).eval()


def check_class_name(directory: Path, expected: str) -> None:
    """A LoadError naming config.json when its `_class_name` (where given) is not `expected`."""
    config = read_json(directory / "config.json")
    name = config.get("_class_name", expected)
    if name != expected:
        raise LoadError(f"{directory / 'config.json'}: _class_name {name!r}, expected {expected!r}")


def load_diffusers_model(cls: type, directory: Path, dtype: torch.dtype, *, check_class: bool = True) -> Any:
    """cls.from_pretrained of a local directory (no hub), in `dtype`; diffusers' multi-line errors as one
    LoadError naming the directory. check_class: refuse a config.json naming another class first."""
    if check_class:
        check_class_name(directory, cls.__name__)
    try:
        return cls.from_pretrained(str(directory), local_files_only=True, torch_dtype=dtype)
    except Exception as err:  # diffusers raises OSError/ValueError/RuntimeError with multi-line messages
        raise LoadError(f"{directory}: cannot load {cls.__name__} ({one_line(err)})") from err


def load_wan_components(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
    text_weights: bool = True,
    reads: Mapping[str, Reads] | None = None,
) -> WanComponents:
    """All components of a diffusers-format Wan directory (or an original-layout Wan2.2 A14B or Wan2.1
    T2V / VACE one, see mmgen.loading.original_dir); transformers, text and image encoders in `dtype`.

    The VAE defaults to float32, as Wan's reference code and diffusers' examples run it.
    host: a PinnedStore the transformers and the text encoder are read into (offload placements).
    text_weights: False = no text encoder kept, its structure only (load_umt5_encoder's keep=False): a
    rank whose text comes from the rank that encodes (mmgen.parallel.share.reads_for_world).
    reads: {component (wan_read_bytes' names): what of it this process reads (load_into_module's
    `read`)}: a rank's part (mmgen.parallel.share.SplitReads), share_reads completing the rest where it
    is kept; a component not named is read whole (the text encoder: where kept).
    """
    directory = Path(directory)
    original = None
    if not (directory / MODEL_INDEX).exists():
        if is_original_a14b(directory):  # the Wan2.2 A14B repository layout (high/low_noise_model/)
            original = load_original_a14b
        elif is_original_wan21(directory):  # one Wan2.1 DiT at the root (T2V, VACE)
            original = load_original_wan21
    if original is not None:
        return original(
            directory,
            dtype=dtype,
            device=device,
            vae_dtype=vae_dtype,
            host=host,
            text_weights=text_weights,
            reads=reads,
        )
    index = read_model_index(directory)
    # The variant's marks (read_model_index checked them).
    two_experts = _is_set(index.get("transformer_2"))
    with_image = _is_set(index.get("image_encoder"))
    expand_timesteps = bool(index.get("expand_timesteps", False))
    defaults = read_generation_defaults(
        directory, expand_timesteps=expand_timesteps, two_experts=two_experts, image_encoder=with_image
    )
    # mmgen's own components first: their errors come before diffusers is even imported.
    reads = reads or {}
    transformer = load_wan_dit(
        directory / "transformer", dtype=dtype, device=device, host=host, read=reads.get("transformer", True)
    )
    transformer_2 = None
    if two_experts:
        read = reads.get("transformer_2", True)
        transformer_2 = load_wan_transformer(
            directory / "transformer_2", dtype=dtype, device=device, host=host, read=read
        )
    image_encoder = image_preprocess = None
    if with_image:
        image_encoder = load_clip_vision(directory / "image_encoder", dtype=dtype, device=device)
        image_preprocess = load_image_preprocess(directory / "image_processor")
    text_encoder = load_umt5_encoder(
        directory / "text_encoder",
        dtype=dtype,
        device=device,
        host=host,
        read=reads.get("text_encoder", text_weights),
        keep=text_weights,
    )
    tokenizer = TextTokenizer.from_dir(directory / "tokenizer")
    scheduler = load_scheduler(directory / "scheduler", expected_class=index["scheduler"][1])
    vae = load_vae(
        directory / "vae", dtype=vae_dtype, device=device, decode_only=decodes_only(directory, index)
    )
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


def wan_read_bytes(directory: Path) -> dict[str, int]:
    """{component: its checkpoint's bytes} of the Wan directory's components a world's ranks can read in parts
    (load_wan_components' `reads`; mmgen.parallel.share.SplitReads), from the checkpoints' headers: the
    text encoder ("text_encoder", of a diffusers-format directory: the original layouts' .pth is read
    whole) first, then the transformers ("transformer", "transformer_2")."""
    directory = Path(directory)
    if is_original_a14b(directory):
        folders = {"transformer": directory / HIGH_NOISE, "transformer_2": directory / LOW_NOISE}
        return {name: checkpoint_bytes(find_weight_files(path)) for name, path in folders.items()}
    if not (directory / MODEL_INDEX).exists():  # the original Wan2.1 layout: one DiT at the root
        return {"transformer": checkpoint_bytes(find_weight_files(directory))}
    found = {"text_encoder": umt5_bytes(directory / "text_encoder")}
    two_experts = _is_set(read_model_index(directory).get("transformer_2"))
    for name in ("transformer", "transformer_2") if two_experts else ("transformer",):
        found[name] = checkpoint_bytes(find_weight_files(directory / name))
    return found


def decodes_only(directory: Path, index: dict[str, Any]) -> bool:
    """Whether the pipeline of a checked directory (read_model_index) never encodes: text-to-video,
    whose DiT takes the noise latents alone (in_channels = the VAE's z_dim) and no control (VACE's
    vace_layers), without an image encoder or TI2V's expand_timesteps. Image and control inputs
    are encoded by diffusers' VAE."""
    transformer = read_json(directory / "transformer" / "config.json")
    z_dim = read_json(directory / "vae" / "config.json").get("z_dim", wan_vae.WanVAEConfig.z_dim)
    return (
        transformer.get("in_channels", WanConfig.in_channels) == z_dim
        and "vace_layers" not in transformer
        and not _is_set(index.get("image_encoder"))
        and not index.get("expand_timesteps", False)
    )


def _is_set(entry: Any) -> bool:
    # diffusers writes absent optional components as [null, null].
    return entry is not None and entry != [None, None]
