"""The Wan models and pipelines the benchmarks time: presets at full size, a tiny config for CPU smoke
runs, diffusers' WanTransformer3DModel and mmgen's WanDiT holding the same random bf16 weights, one CFG
step's inputs and FLOPs, and the whole pipeline's components (UMT5-XXL-size encoder, DiT, Wan2.1 VAE)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgen.loading.wan_transformer import wan_dit_from_tensors
from mmgen.models.umt5 import UMT5Config, UMT5Encoder
from mmgen.models.wan import WanConfig, WanDiT

RANDOM = Path("<random weights>")

MODELS = {
    "1.3b": (WanConfig.wan21_t2v_1_3b(), (480, 832, 81)),
    "14b": (WanConfig.wan21_t2v_14b(), (720, 1280, 81)),
}

TINY = WanConfig(
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=32,
    ffn_dim=256,
    num_layers=2,
    text_len=32,
)

TINY_VIDEO = (64, 96, 9)  # height, width, frames of the --tiny runs


def model_and_video(args) -> tuple[WanConfig, tuple[int, int, int]]:
    """The config and (height, width, frames) a script's --model/--tiny/--height/--width/--frames ask for."""
    config, video = (TINY, TINY_VIDEO) if args.tiny else MODELS[args.model]
    return config, (args.height or video[0], args.width or video[1], args.frames or video[2])


def add_model_args(parser) -> None:
    """--model, --tiny, --height, --width, --frames (read back by model_and_video)."""
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny config and sizes (harness smoke run, CPU ok)"
    )
    parser.add_argument("--height", type=int, help="video height (default: the model's)")
    parser.add_argument("--width", type=int, help="video width")
    parser.add_argument("--frames", type=int, help="video frames (4k + 1)")


def build_models(config: WanConfig, device: torch.device, *, seed: int = 0) -> tuple[torch.nn.Module, WanDiT]:
    """diffusers WanTransformer3DModel (bf16, its fp32 modules fp32) and mmgen WanDiT with the same weights.

    Built directly on `device` (diffusers' own initialisation, seeded with `seed`); the two models
    share every weight tensor (no second copy)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: a 14B model built in fp32 would need 57 GB
    try:
        with torch.device(device):
            reference = WanTransformer3DModel(**config.to_diffusers_config())
    finally:
        torch.set_default_dtype(previous)
    keep = WanTransformer3DModel._keep_in_fp32_modules  # what from_pretrained(torch_dtype=bf16) keeps fp32
    for name, param in reference.named_parameters():
        if any(part in keep for part in name.split(".")):
            param.data = param.data.float()
    reference.eval().requires_grad_(False)
    model = wan_dit_from_tensors(
        config,
        {name: (t, RANDOM) for name, t in reference.state_dict().items()},
        source=RANDOM,
        dtype=torch.bfloat16,
        device=device,
    )
    return reference, model


def random_dit(config: WanConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> WanDiT:
    """Random weights made directly on `device` in their load dtype (dtype; fp32 where loading keeps
    fp32): the module is built on the meta device, so 14B never exists in fp32 or on the host.

    Matrices ~ N(0, 1/fan_in) (activations stay O(1) through the layers), norm weights 1, biases 0.
    """
    with torch.device("meta"):
        model = WanDiT(config).eval()
    return random_weights(model, device, dtype, keeps_fp32=WanDiT.keeps_fp32)


def random_weights(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    keeps_fp32: Callable[[str], bool] = lambda name: False,
) -> torch.nn.Module:
    """model (built on the meta device) with random parameters made on `device` in dtype (float32 where
    keeps_fp32(name)): matrices ~ N(0, 1/fan_in), norm weights 1, biases 0. Returns it in eval mode."""
    for name, param in list(model.named_parameters()):
        kind = torch.float32 if keeps_fp32(name) else dtype
        value = torch.empty(param.shape, dtype=kind, device=device)
        if param.dim() > 1:
            value.normal_(0.0, (param[0].numel()) ** -0.5)
        else:
            value.fill_(0.0 if name.endswith("bias") else 1.0)
        module_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_name), attribute, torch.nn.Parameter(value, requires_grad=False))
    return model.eval()


@dataclass(frozen=True)
class Work:
    """FLOPs of one DiT call: attention (self, cross) and linear layers."""

    self_attn: float
    cross_attn: float
    linear: float

    @property
    def attention(self) -> float:
        return self.self_attn + self.cross_attn

    @property
    def total(self) -> float:
        return self.attention + self.linear


def dit_flops(config: WanConfig, batch: int, tokens: int, text_len: int) -> Work:
    """Matmul FLOPs of one forward: 2 x weights x tokens for linears, 4 S Sk d per layer for attention."""
    d, ffn, layers = config.dim, config.ffn_dim, config.num_layers
    patch = math.prod(config.patch_size)
    video, text = batch * tokens, batch * text_len
    per_block = 2 * video * (4 * d * d + 2 * d * d + 2 * d * ffn) + 2 * text * (2 * d * d)
    embed = 2 * video * (config.in_channels * patch * d + d * config.out_channels * patch)
    embed += 2 * text * (config.text_dim * d + d * d)
    return Work(
        self_attn=layers * batch * 4 * tokens * tokens * d,
        cross_attn=layers * batch * 4 * tokens * text_len * d,
        linear=layers * per_block + embed,
    )


@dataclass(frozen=True)
class Inputs:
    """One CFG step's DiT inputs: latents bf16 [2, C, F', H', W'], timestep [2], text bf16 [2, L, text_dim]."""

    latents: torch.Tensor
    timestep: torch.Tensor
    text: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.latents.shape[2] * self.latents.shape[3] * self.latents.shape[4] // 4


def make_inputs(config: WanConfig, video: tuple[int, int, int], device: torch.device) -> Inputs:
    """The same noise for cond and uncond (as the pipeline batches them), two prompts zero-padded to text_len."""
    height, width, frames = video
    gen = torch.Generator().manual_seed(1)
    shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, generator=gen).expand(2, -1, -1, -1, -1)
    text = torch.randn(2, config.text_len, config.text_dim, generator=gen)
    text[0, config.text_len // 8 :] = 0  # the prompt: 1/8 of the tokens valid, the rest zero padding
    text[1, config.text_len // 32 :] = 0  # the negative prompt: shorter
    return Inputs(
        latents=latents.to(device, torch.bfloat16),
        timestep=torch.full((2,), 500.0, device=device),
        text=text.to(device, torch.bfloat16),
    )


@dataclass(frozen=True)
class Parts:
    """The pipeline components both sides share (random weights), and the video they make."""

    reference: torch.nn.Module  # diffusers WanTransformer3DModel, same tensors as `model`
    model: torch.nn.Module  # mmgen WanDiT
    encoder: torch.nn.Module  # mmgen UMT5Encoder
    hf_encoder: torch.nn.Module  # transformers UMT5EncoderModel, same weights
    tokenizer_dir: Path
    vae: torch.nn.Module  # diffusers AutoencoderKLWan
    scheduler: object  # diffusers UniPCMultistepScheduler (flow shift 3)
    video: tuple[int, int, int]  # height, width, frames


def text_and_vae_configs(tiny: bool, *, layers: int = 24, vocab: int = 256384) -> tuple[UMT5Config, dict]:
    """(UMT5Config, AutoencoderKLWan kwargs): a tiny UMT5 and small VAE, or UMT5-XXL's width with `layers`
    and `vocab` (24 and 256,384: the text encoder of every Wan2.1 model) and the Wan2.1 VAE."""
    from mmgen.default_model import VAE

    if tiny:
        text = UMT5Config(vocab_size=512, d_model=TINY.text_dim, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        vae = {**copy.deepcopy(VAE), "z_dim": 16, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}
        return text, vae
    text = UMT5Config(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64)
    return text, {}  # diffusers' defaults are the Wan2.1 VAE


def build_parts(
    args: argparse.Namespace, device: torch.device, *, vae_dtype: torch.dtype = torch.float32
) -> Parts:
    """A UMT5-XXL-size text encoder, the DiT of --model (or --tiny) and the Wan2.1 VAE, random weights on `device`.

    Everything is built directly on the device (a 14B DiT built on the CPU first would take minutes);
    the DiT and text encoder in bf16, the VAE in `vae_dtype` (float32 as diffusers' Wan pipelines run it).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config as HFUMT5Config
    from transformers import UMT5EncoderModel

    from mmgen.default_model import WORDS
    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.loading.tokenizer import build_word_tokenizer

    config, video = model_and_video(args)
    text_config, vae_config = text_and_vae_configs(args.tiny)
    reference, model = build_models(config, device)
    workdir = Path(tempfile.mkdtemp(prefix="mmgen-bench-"))
    build_word_tokenizer(list(WORDS), workdir / "tokenizer", model_max_length=config.text_len)

    torch.manual_seed(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf_encoder = UMT5EncoderModel(HFUMT5Config(**text_config.to_hf_config())).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.device("meta"):
        encoder = UMT5Encoder(text_config)
    tensors = {
        k: (v, RANDOM) for k, v in hf_encoder.state_dict().items() if k != "encoder.embed_tokens.weight"
    }
    load_into_module(encoder, tensors, source=RANDOM, dtype=torch.bfloat16, device=device)
    encoder.eval()
    with torch.device(device):
        vae = AutoencoderKLWan(**vae_config).eval()
    if vae_dtype != torch.float32:
        vae = vae.to(vae_dtype)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return Parts(reference, model, encoder, hf_encoder, workdir / "tokenizer", vae, scheduler, video)


def mmgen_pipeline(parts: Parts, steps: int, device: torch.device | None = None):
    """mmgen's WanT2VPipeline over `parts`, defaulting to their video size and `steps` steps; `device`:
    where the DiT computes when its weights are elsewhere (None: where they are)."""
    from mmgen.loading.tokenizer import TextTokenizer
    from mmgen.loading.wan_components import GenerationDefaults
    from pipelines.wan_t2v import WanT2VPipeline

    height, width, frames = parts.video
    defaults = GenerationDefaults(height=height, width=width, num_frames=frames, num_inference_steps=steps)
    tokenizer = TextTokenizer.from_dir(parts.tokenizer_dir)
    return WanT2VPipeline(
        parts.model, parts.encoder, tokenizer, parts.vae, parts.scheduler, defaults=defaults, device=device
    )


# What `write_random_wan_dir` can put in text_encoder/: UMT5-XXL itself (Wan2.1's encoder, ~11.4 GB in
# bf16), or a clearly labelled reduced one of the same width (the DiT's text_dim) that writes and loads
# in seconds. The text encoder runs once per job in both phases of a serving benchmark; its size does
# not change what the server adds per job.
TEXT_ENCODERS = {
    "full": ("UMT5-XXL (24 layers, 256384-token vocabulary)", 24, 256384),
    "reduced": (
        "REDUCED UMT5 (2 of UMT5-XXL's 24 layers, 1024-token vocabulary; not Wan2.1's encoder)",
        2,
        1024,
    ),
}
SHARD_BYTES = 2 << 30
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
WRITERS = 8  # shards written at once: d2h copies and file writes release the GIL


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One .safetensors file: an 8-byte little-endian header size, the JSON header (space-padded to 8
    bytes), then each tensor's bytes in order. Written from each tensor's own memory (moved to the CPU
    one tensor at a time): safetensors' save_file first copies every tensor into Python bytes."""
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(len(raw).to_bytes(8, "little"))
        file.write(raw)
        for tensor in tensors.values():
            cpu = tensor.detach().to("cpu").contiguous().reshape(-1)
            file.write(cpu.view(torch.uint8).numpy())


def _save_shards(
    tensors: dict[str, torch.Tensor], directory: Path, stem: str, shard_bytes: int = SHARD_BYTES
) -> int:
    """Write tensors as <stem>-NNNNN.safetensors shards of ~shard_bytes, WRITERS shards at once (mmgen
    reads every *.safetensors of a component directory). Returns the bytes written."""
    from concurrent.futures import ThreadPoolExecutor

    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    paths = [
        directory / f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    with ThreadPoolExecutor(min(WRITERS, len(shards))) as pool:
        list(pool.map(_write_safetensors, paths, shards))  # list(): a writer's error is raised here
    return total


# Wan2.2-T2V-A14B as its -Diffusers release holds it: two experts of Wan2.1-14B's shape, `transformer`
# for t >= boundary_ratio x 1000 (high noise) and `transformer_2` below, boundary_ratio in
# model_index.json; the Wan2.1 VAE; the flow shift of the Wan2.2 code's t2v sampler.
RANDOM_KINDS = {"wan13b": ("1.3b", False), "wan14b": ("14b", False), "a14b": ("14b", True)}
WAN21_FLOW_SHIFT = 3.0


def dit_label(dit_size: str, *, two_experts: bool = False, tiny: bool = False) -> str:
    """What random_weights.json calls the DiT(s) of a directory write_random_wan_dir made."""
    if tiny:
        return "tiny A14B-shaped (two experts)" if two_experts else "tiny"
    return "Wan2.2-T2V-A14B" if two_experts else f"Wan2.1-T2V-{dit_size.upper()}"


def write_random_wan_dir(
    directory: Path,
    *,
    tiny: bool = False,
    text_encoder: str = "full",
    device: str = "cuda",
    seed: int = 0,
    dit_size: str = "1.3b",
    two_experts: bool = False,
) -> dict:
    """Write a diffusers-format Wan2.1-T2V directory with random weights (bf16 DiT and text encoder, fp32
    VAE) that `load_pipeline(directory, ...)` and `mmgen serve --model directory` load.

    tiny: the TINY DiT, a tiny UMT5 and a small VAE (CPU smoke runs); else Wan2.1-T2V's DiT of
    `dit_size` (a MODELS key: 1.3b, 14b), the Wan2.1 VAE and the text encoder `text_encoder` names
    (TEXT_ENCODERS). two_experts: Wan2.2-T2V-A14B's layout instead (with dit_size 14b, or tiny): a
    second DiT `transformer_2` of other random weights, boundary_ratio and its flow shift. Weights are
    made on `device` (diffusers' and transformers' own initialisation, as build_parts makes them) and
    written a few shards at once. Returns what was written: the DiT's and the text encoder's labels,
    bytes per component, seconds.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config as HFUMT5Config
    from transformers import UMT5EncoderModel

    from mmgen.default_model import WORDS, _model_index
    from mmgen.loading.original_dir import BOUNDARY, SAMPLE_SHIFT
    from mmgen.loading.tokenizer import build_word_tokenizer

    if two_experts and not tiny and dit_size != "14b":
        raise ValueError(f"two_experts: Wan2.2 A14B's experts are 14b DiTs, not {dit_size}")
    start = time.perf_counter()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = TINY if tiny else MODELS[dit_size][0]
    label, layers, vocab = TEXT_ENCODERS[text_encoder]
    if tiny:
        label = "tiny UMT5 (2 layers, d_model 64)"
    text_config, vae_config = text_and_vae_configs(tiny, layers=layers, vocab=vocab)
    # The high-noise expert keeps the one-DiT directory's seed; the low-noise one its own.
    experts = {"transformer": seed, **({"transformer_2": seed + 3} if two_experts else {})}
    written: dict[str, int] = {}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: never an fp32 copy
    try:
        for folder, expert_seed in experts.items():
            torch.manual_seed(expert_seed)
            with torch.device(device):
                dit = WanTransformer3DModel(**config.to_diffusers_config())
            keep = WanTransformer3DModel._keep_in_fp32_modules
            state = {
                name: (t.float() if any(part in keep for part in name.split(".")) else t)
                for name, t in dit.state_dict().items()
            }
            written[folder] = _save_shards(state, directory / folder, "diffusion_pytorch_model")
            del dit, state
            _write_json(
                directory / folder / "config.json",
                {"_class_name": "WanTransformer3DModel", **config.to_diffusers_config()},
            )
        torch.manual_seed(seed + 1)
        with torch.device(device):
            encoder = UMT5EncoderModel(HFUMT5Config(**text_config.to_hf_config())).eval()
        state = {k: v for k, v in encoder.state_dict().items() if k != "encoder.embed_tokens.weight"}
        written["text_encoder"] = _save_shards(state, directory / "text_encoder", "model")
        del encoder, state
        _write_json(directory / "text_encoder" / "config.json", text_config.to_hf_config())
    finally:
        torch.set_default_dtype(previous)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(**vae_config).eval()  # fp32 on the CPU: small
    vae.save_pretrained(str(directory / "vae"), safe_serialization=True)
    written["vae"] = sum(p.numel() * p.element_size() for p in vae.parameters())
    del vae
    UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=SAMPLE_SHIFT["t2v"] if two_experts else WAN21_FLOW_SHIFT,
    ).save_pretrained(str(directory / "scheduler"))
    build_word_tokenizer(list(WORDS), directory / "tokenizer", model_max_length=config.text_len)
    index = _model_index()
    if two_experts:
        index |= {"transformer_2": index["transformer"], "boundary_ratio": BOUNDARY["t2v"]}
    _write_json(directory / "model_index.json", index)
    info = {
        "directory": str(directory),
        "dit": dit_label(dit_size, two_experts=two_experts, tiny=tiny),
        "text_encoder": label,
        "bytes": written,
        "seconds": time.perf_counter() - start,
    }
    _write_json(directory / "random_weights.json", info)  # what this directory is, for whoever finds it
    return info


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
