"""Load a checkpoint in the original Wan repository layout (no model_index.json) as a whole pipeline.

Two layouts, as the Wan-AI repositories ship them:

    Wan2.2 A14B (Wan2.2-T2V-A14B, -I2V-A14B):
    high_noise_model/                       config.json (_class_name WanModel: dim, num_heads, in_dim,
                                            model_type, ...) + sharded diffusion_pytorch_model*.safetensors
    low_noise_model/                        the same for the low-noise expert

    Wan2.1 one model (Wan2.1-T2V-1.3B / -14B, Wan2.1-VACE-1.3B / -14B):
    config.json                             the DiT's (model_type t2v, or vace with vace_layers and
                                            vace_in_dim: _class_name VaceWanModel)
    diffusion_pytorch_model*.safetensors    its weights (a VACE checkpoint adds vace_patch_embedding
                                            and vace_blocks.N.*, before_proj / after_proj)

    and in both:
    Wan2.1_VAE.pth                          the VAE's state dict in the original module names
    models_t5_umt5-xxl-enc-bf16.pth         the UMT5-XXL encoder's state dict in the original names
    google/umt5-xxl/                        the tokenizer (tokenizer.json)
    configuration.json                      optional (framework/task); nothing mmgen needs

What the repository does not hold comes from the Wan code's configs and generate.py, keyed by the
model_type: Wan2.2's boundary (t2v 0.875, i2v 0.900) and sample_shift (t2v 12.0, i2v 5.0); Wan2.1's
sample_shift (t2v 5.0, vace 16), each for a flow-matching UniPC scheduler. The high-noise expert is
`transformer` (t >= boundary), the low-noise one `transformer_2`, as diffusers names them. Shapes are
read from the tensors (the VAE's and text encoder's widths, depths, stages), so every missing,
unknown or misshapen tensor is the usual LoadError naming the file and the tensor.

Not read here: TI2V-5B's Wan2.2_VAE.pth (a different VAE design) and Wan2.1 I2V / FLF2V's
open-clip image encoder .pth; those load from their -Diffusers repositories (a LoadError says so).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError
from mmgen.loading.safetensors_dir import Reads, load_into_module, read_json
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.loading.wan_components import WanComponents, check_compatible, read_generation_defaults
from mmgen.loading.wan_transformer import load_wan_transformer
from mmgen.loading.wan_vace import load_wan_dit
from mmgen.loading.wan_vae import build_wan_vae_decoder
from mmgen.models.umt5 import UMT5Config, UMT5Encoder
from mmgen.models.wan_vae import read_config
from mmgen.placement.tensors import PinnedStore
from mmgen.schedulers.unipc_flow import FlowUniPCConfig, FlowUniPCScheduler

HIGH_NOISE = "high_noise_model"
LOW_NOISE = "low_noise_model"
VAE_FILE = "Wan2.1_VAE.pth"
WAN22_VAE_FILE = "Wan2.2_VAE.pth"
T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
TOKENIZER_DIR = Path("google") / "umt5-xxl"
# The Wan2.2 code's per-task values (wan/configs/wan_{t2v,i2v}_A14B.py): the expert switch as a
# fraction of the 1000 training timesteps, and the flow shift its sampler uses.
BOUNDARY = {"t2v": 0.875, "i2v": 0.900}
SAMPLE_SHIFT = {"t2v": 12.0, "i2v": 5.0}
# Wan2.1's generate.py: sample_shift 5.0, and 16 for VACE (and FLF2V, not read here).
WAN21_SAMPLE_SHIFT = {"t2v": 5.0, "vace": 16.0}
WAN21_CONFIG = "config.json"
NUM_TRAIN_TIMESTEPS = 1000


def is_original_a14b(directory: Path) -> bool:
    """Whether `directory` has the two expert folders of the original Wan2.2 A14B layout."""
    directory = Path(directory)
    return (directory / HIGH_NOISE).is_dir() and (directory / LOW_NOISE).is_dir()


def is_original_wan21(directory: Path) -> bool:
    """Whether `directory` holds one original Wan2.1 DiT at its root (config.json and its safetensors)
    and no model_index.json (a diffusers directory's)."""
    directory = Path(directory)
    return (
        (directory / WAN21_CONFIG).is_file()
        and not (directory / "model_index.json").exists()
        and any(directory.glob("diffusion_pytorch_model*.safetensors"))
    )


def load_original_a14b(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
    text_weights: bool = True,
    reads: Mapping[str, Reads] | None = None,
):
    """WanComponents of an original-layout Wan2.2 A14B directory (see the module docstring).

    host: a PinnedStore the two experts are read into (offload placements; the .pth text encoder is
    read whole by torch.load, then cast). text_weights, reads: as load_wan_components' (the experts are
    "transformer" and "transformer_2"; the .pth text encoder is read whole where kept)."""
    directory = Path(directory)
    model_type = _expert_model_type(directory)
    _check_shared_files(directory, "original Wan2.2 A14B layout")
    reads = reads or {}
    high, low = (
        load_wan_transformer(
            directory / folder, dtype=dtype, device=device, host=host, read=reads.get(name, True)
        )
        for folder, name in ((HIGH_NOISE, "transformer"), (LOW_NOISE, "transformer_2"))
    )
    if high.config.image_dim is not None:
        raise LoadError(f"{directory / HIGH_NOISE}: an image path (img_emb.*) is not part of Wan2.2 A14B")
    text_encoder, tokenizer, vae = _shared_components(
        directory, dtype, device, vae_dtype, model_type, text_weights
    )
    defaults = read_generation_defaults(directory, two_experts=True)
    components = WanComponents(
        high,
        text_encoder,
        tokenizer,
        vae,
        flow_scheduler(SAMPLE_SHIFT[model_type]),
        defaults,
        directory,
        transformer_2=low,
        boundary_ratio=BOUNDARY[model_type],
    )
    check_compatible(components)
    return components


def load_original_wan21(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_dtype: torch.dtype = torch.float32,
    host: PinnedStore | None = None,
    text_weights: bool = True,
    reads: Mapping[str, Reads] | None = None,
):
    """WanComponents of an original-layout Wan2.1 directory, T2V or VACE (see the module docstring).
    text_weights, reads: as load_wan_components' (the .pth text encoder is read whole where kept)."""
    directory = Path(directory)
    config_path = directory / WAN21_CONFIG
    model_type = read_json(config_path).get("model_type", "t2v")
    if model_type not in WAN21_SAMPLE_SHIFT:
        raise LoadError(
            f"{config_path}: model_type {model_type!r} is not read from the original Wan2.1 layout "
            f"(allowed: {', '.join(WAN21_SAMPLE_SHIFT)}); an image-conditioned model loads from its "
            "-Diffusers repository"
        )
    _check_shared_files(directory, "original Wan2.1 layout")
    read = (reads or {}).get("transformer", True)
    transformer = load_wan_dit(directory, dtype=dtype, device=device, host=host, read=read)
    text_encoder, tokenizer, vae = _shared_components(
        directory, dtype, device, vae_dtype, model_type, text_weights
    )
    components = WanComponents(
        transformer,
        text_encoder,
        tokenizer,
        vae,
        flow_scheduler(WAN21_SAMPLE_SHIFT[model_type]),
        read_generation_defaults(directory),
        directory,
    )
    check_compatible(components)
    return components


def _check_shared_files(directory: Path, layout: str) -> None:
    for name in (VAE_FILE, T5_FILE):
        if not (directory / name).is_file():
            extra = (
                " (a TI2V-5B Wan2.2_VAE.pth is not read here)"
                if (directory / WAN22_VAE_FILE).exists()
                else ""
            )
            raise LoadError(f"{directory / name}: file not found ({layout}){extra}")


def _shared_components(
    directory: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    vae_dtype: torch.dtype,
    model_type: str,
    text_weights: bool,
) -> tuple[UMT5Encoder, TextTokenizer, Any]:
    """The text encoder, tokenizer and VAE both original layouts ship under the same names; a t2v
    model only decodes (mmgen's Wan2.1 decoder), i2v and vace encode (diffusers' VAE)."""
    text_encoder = load_original_t5(directory / T5_FILE, dtype=dtype, device=device, weights=text_weights)
    tokenizer = TextTokenizer.from_dir(directory / TOKENIZER_DIR)
    vae = load_original_vae(
        directory / VAE_FILE, dtype=vae_dtype, device=device, decode_only=model_type == "t2v"
    )
    return text_encoder, tokenizer, vae


def _expert_model_type(directory: Path) -> str:
    """The experts' model_type ('t2v' / 'i2v'), equal in both config.json files."""
    types = []
    for name in (HIGH_NOISE, LOW_NOISE):
        path = directory / name / "config.json"
        model_type = read_json(path).get("model_type", "t2v")
        if model_type not in BOUNDARY:
            raise LoadError(
                f"{path}: model_type {model_type!r} is not a Wan2.2 A14B expert; allowed: {', '.join(BOUNDARY)}"
            )
        types.append(model_type)
    if types[0] != types[1]:
        raise LoadError(f"{directory}: {HIGH_NOISE} is {types[0]!r} but {LOW_NOISE} is {types[1]!r}")
    return types[0]


def flow_scheduler(shift: float) -> FlowUniPCScheduler:
    """UniPC in flow-matching mode with the Wan sampler's shift (what -Diffusers repos ship)."""
    return FlowUniPCScheduler(FlowUniPCConfig(num_train_timesteps=NUM_TRAIN_TIMESTEPS, flow_shift=shift))


def read_pth(path: Path) -> dict[str, tuple[torch.Tensor, Path]]:
    """A .pth state dict as {name: (tensor, path)}; tensors only (weights_only), memory-mapped."""
    if not path.is_file():
        raise LoadError(f"{path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # pickle, zip and torch errors alike
        raise LoadError(f"{path}: not a readable PyTorch state dict ({type(err).__name__}: {err})") from err
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise LoadError(f"{path}: expected a state dict of tensors")
    return {str(key): (tensor, path) for key, tensor in state.items()}


# ----------------------------------------------------------------------------------------------
# the text encoder: Wan's T5Encoder names -> transformers' UMT5 names (mmgen's UMT5Encoder)

T5_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
T5_BLOCK_NAMES = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    # gated GELU: the original computes fc1(x) * gelu(gate(x)); transformers wi_1(x) * gelu(wi_0(x))
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def t5_key(key: str) -> str:
    """The UMT5Encoder name of an original Wan T5 key (unknown keys map to a name no parameter has)."""
    if key == "token_embedding.weight":
        return "shared.weight"
    if key == "norm.weight":
        return "encoder.final_layer_norm.weight"
    match = T5_BLOCK.fullmatch(key)
    if match and match.group(2) in T5_BLOCK_NAMES:
        return f"encoder.block.{match.group(1)}.{T5_BLOCK_NAMES[match.group(2)]}"
    return f"<no UMT5 name>.{key}"


def load_original_t5(
    path: Path, *, dtype: torch.dtype, device: str | torch.device, weights: bool = True
) -> UMT5Encoder:
    """mmgen's UMT5Encoder from Wan's T5 encoder .pth; its shape read from the tensors (memory-mapped).
    weights: False = the structure only, on the meta device (as mmgen.loading.umt5.load_umt5_encoder's)."""
    tensors = read_pth(path)
    config = _t5_config(tensors, path)
    with torch.device("meta"):
        model = UMT5Encoder(config)
    device = device if weights else "meta"
    load_into_module(model, tensors, source=path, dtype=dtype, device=device, rename=t5_key, read=weights)
    return model.eval()


def _shape_reader(tensors: Mapping[str, tuple[torch.Tensor, Path]], path: Path, what: str):
    """key -> the shape of tensors[key]; a LoadError naming `path` and `what` for a missing one."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in tensors:
            raise LoadError(f"{path}: lacks tensor {key!r} ({what})")
        return tuple(tensors[key][0].shape)

    return shape


def _t5_config(tensors: Mapping[str, tuple[torch.Tensor, Path]], path: Path) -> UMT5Config:
    shape = _shape_reader(tensors, path, "original Wan T5 encoder")
    vocab, d_model = shape("token_embedding.weight")
    d_ff = shape("blocks.0.ffn.fc1.weight")[0]
    buckets, heads = shape("blocks.0.pos_embedding.embedding.weight")
    layers = len({m.group(1) for key in tensors if (m := T5_BLOCK.fullmatch(key))})
    if d_model % heads:
        raise LoadError(f"{path}: d_model {d_model} is not a multiple of the {heads} heads")
    return UMT5Config(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
    )


# ----------------------------------------------------------------------------------------------
# the VAE: Wan2.1's WanVAE names -> diffusers' AutoencoderKLWan names

RESIDUAL_NAMES = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
TOP_NAMES = {
    "conv1.": "quant_conv.",
    "conv2.": "post_quant_conv.",
    "encoder.conv1.": "encoder.conv_in.",
    "decoder.conv1.": "decoder.conv_in.",
    "encoder.head.0.": "encoder.norm_out.",
    "encoder.head.2.": "encoder.conv_out.",
    "decoder.head.0.": "decoder.norm_out.",
    "decoder.head.2.": "decoder.conv_out.",
}
MIDDLE = {"0": "mid_block.resnets.0", "1": "mid_block.attentions.0", "2": "mid_block.resnets.1"}
STAGED = re.compile(r"(encoder|decoder)\.(downsamples|upsamples|middle)\.(\d+)\.(.+)")


def _block_kinds(tensors: Mapping, side: str, stack: str) -> dict[int, str]:
    """Index -> 'res' / 'resample' (/ 'other') of the blocks in encoder.downsamples or decoder.upsamples."""
    kinds: dict[int, str] = {}
    for key in tensors:
        match = STAGED.fullmatch(key)
        if match and match.group(1) == side and match.group(2) == stack:
            rest = match.group(4)
            kind = (
                "res"
                if rest in RESIDUAL_NAMES
                else "resample"
                if rest.startswith(("resample.", "time_conv."))
                else "other"
            )
            index = int(match.group(3))
            kinds[index] = kind if kinds.get(index, kind) == kind else "other"
    return dict(sorted(kinds.items()))


def vae_key_map(tensors: Mapping) -> dict[str, str]:
    """Every original key -> its AutoencoderKLWan name (keys that fit no rule map to a name no parameter has)."""
    # The decoder's blocks form one flat list in the original; diffusers groups them into stages,
    # each ending at its upsampler (the last stage has none).
    up_names: dict[int, str] = {}
    stage = position = 0
    for index, kind in _block_kinds(tensors, "decoder", "upsamples").items():
        if kind == "resample":
            up_names[index] = f"up_blocks.{stage}.upsamplers.0"
            stage, position = stage + 1, 0
        else:
            up_names[index] = f"up_blocks.{stage}.resnets.{position}"
            position += 1
    return {key: _vae_name(key, up_names) for key in tensors}


def _vae_name(key: str, up_names: dict[int, str]) -> str:
    for old, new in TOP_NAMES.items():
        if key.startswith(old):
            return new + key[len(old) :]
    match = STAGED.fullmatch(key)
    if match is None:
        return f"<no AutoencoderKLWan name>.{key}"
    side, stack, index, rest = match.groups()
    rest = RESIDUAL_NAMES.get(rest, rest)
    if stack == "middle":
        block = MIDDLE.get(index)
    elif stack == "downsamples":
        block = f"down_blocks.{index}"
    else:
        block = up_names.get(int(index))
    if block is None:
        return f"<no AutoencoderKLWan name>.{key}"
    return f"{side}.{block}.{rest}"


def vae_config(tensors: Mapping[str, tuple[torch.Tensor, Path]], path: Path) -> dict:
    """AutoencoderKLWan's config read from a Wan2.1 VAE state dict's shapes."""
    shape = _shape_reader(tensors, path, "original Wan2.1 VAE")
    base_dim = shape("encoder.conv1.weight")[0]
    z_dim = shape("conv1.weight")[0] // 2
    stages: list[list[int]] = [[]]
    temporal: list[bool] = []
    for index, kind in _block_kinds(tensors, "encoder", "downsamples").items():
        if kind == "res":
            stages[-1].append(shape(f"encoder.downsamples.{index}.residual.6.weight")[0])
        elif kind == "resample":
            temporal.append(f"encoder.downsamples.{index}.time_conv.weight" in tensors)
            stages.append([])
        else:
            raise LoadError(f"{path}: encoder.downsamples.{index} is neither a residual block nor a resample")
    counts = {len(stage) for stage in stages}
    if len(counts) != 1 or 0 in counts:
        raise LoadError(
            f"{path}: encoder stages hold {[len(s) for s in stages]} residual blocks; expected equal"
        )
    dim_mult = [stage[-1] // base_dim for stage in stages]
    if z_dim != 16:
        # diffusers' AutoencoderKLWan defaults hold Wan2.1's 16 latent means and stds; other widths'
        # statistics are not in a .pth file.
        raise LoadError(
            f"{path}: z_dim {z_dim}: only the Wan2.1 VAE (z_dim 16) is read from the original layout; "
            "use a -Diffusers vae/ directory"
        )
    return {
        "base_dim": base_dim,
        "z_dim": z_dim,
        "dim_mult": dim_mult,
        "num_res_blocks": counts.pop(),
        "attn_scales": [],
        "temperal_downsample": temporal,
        "scale_factor_spatial": 2 ** (len(dim_mult) - 1),
        "scale_factor_temporal": 2 ** sum(temporal),
    }


def load_original_vae(
    path: Path, *, dtype: torch.dtype, device: str | torch.device, decode_only: bool = False
) -> Any:
    """The VAE (eval) of a Wan2.1_VAE.pth state dict: mmgen's Wan2.1 decoder when the pipeline only
    decodes, else diffusers' AutoencoderKLWan."""
    tensors = read_pth(path)
    config = vae_config(tensors, path)
    names = vae_key_map(tensors)
    if decode_only:
        return build_wan_vae_decoder(
            read_config(config), tensors, source=path, dtype=dtype, device=device, rename=names.__getitem__
        )
    # diffusers takes ~2 s to import: kept off the request checks' path
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan(**config)
    load_into_module(vae, tensors, source=path, dtype=dtype, device=device, rename=names.__getitem__)
    return vae.eval()
