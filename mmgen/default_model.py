"""The embedded default model: a tiny Wan-architecture checkpoint built from a fixed seed on first use.

`ensure_default_model()` returns a cache directory holding an ordinary diffusers-format Wan
directory (model_index.json, transformer/, text_encoder/, tokenizer/, vae/, scheduler/), so
`mmgen generate` without --model runs the real loading path. Its generation defaults (64x96, 9
frames, 4 steps, guidance 5, 8 fps) are in the directory's mmgen_defaults.json.

Weights: every tensor is drawn from its own generator, seeded from SEED and the tensor's name, so
the bytes are the same on every machine and a tensor's values never depend on the order of the
others. The directory is written under a temp name and renamed into place once complete, so a
concurrent first use or a killed build never leaves a half-built directory under the final name.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmgen.loading.diffusers_dir import DEFAULTS_FILE, MODEL_INDEX, GenerationDefaults
from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
from mmgen.models.umt5 import UMT5Config, UMT5Encoder
from mmgen.models.wan import WanConfig, WanDiT
from mmgen.outputs.writers import fsync_file

NAME = "wan-tiny-v1"  # bump the version whenever anything below changes the built bytes
SEED = 20250101
BUILDING = f".{NAME}.building-"
STALE_BUILD_SECONDS = 120  # a temp build with nothing written for this long was left by a killed process

DEFAULTS = GenerationDefaults(
    height=64, width=96, num_frames=9, num_inference_steps=4, guidance_scale=5.0, negative_prompt="", fps=8
)
Z_DIM = 4
TEXT_DIM = 32
TRANSFORMER = WanConfig(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
)
VAE = {
    "base_dim": 8,
    "z_dim": Z_DIM,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.1, -0.2, 0.05, 0.0],
    "latents_std": [1.2, 0.9, 1.1, 1.0],
}
SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
# The tokenizer's whole words; other words split into known characters or map to <unk>.
WORDS = tuple(
    "a an the of in on at with and or to from by over under near into through behind above below "
    "is are was running walking flying swimming dancing jumping sitting standing playing eating "
    "cat dog bird fish horse fox bear rabbit robot person man woman child people car boat train "
    "tree forest flower garden river lake sea ocean beach mountain sky cloud sun moon star rain snow "
    "city street house room kitchen window road bridge field desert night day morning sunset light "
    "red orange yellow green blue purple pink white black gray golden bright dark small big tiny "
    "old young happy slow fast quiet calm cinematic video photo painting close-up wide shot camera".split()
)


def default_cache_dir() -> Path:
    """$MMGEN_CACHE_DIR, else $XDG_CACHE_HOME/mmgen, else ~/.cache/mmgen."""
    if os.environ.get("MMGEN_CACHE_DIR"):
        return Path(os.environ["MMGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmgen"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The embedded default model's directory, building it first if the cache does not hold it yet."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / NAME
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir)
    temp = Path(tempfile.mkdtemp(prefix=BUILDING, dir=cache_dir))
    try:
        build_default_model(temp)
        _fsync_tree(temp)
        try:
            os.rename(temp, final)
        except OSError:
            if not final.is_dir():  # not "another process finished first": a real failure
                raise
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
    return final


def build_default_model(directory: Path) -> Path:
    """Write the tiny Wan checkpoint into `directory` (which must exist); the same bytes every time."""
    directory = Path(directory)
    build_word_tokenizer(list(WORDS), directory / "tokenizer", model_max_length=TRANSFORMER.text_len)
    vocab = TextTokenizer.from_dir(directory / "tokenizer").vocab_size
    text_encoder = UMT5Config(
        vocab_size=64 * math.ceil(vocab / 64), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    _write_json(directory / "text_encoder" / "config.json", text_encoder.to_hf_config())
    _save_weights(UMT5Encoder, text_encoder, directory / "text_encoder" / "model.safetensors")
    transformer = {"_class_name": "WanTransformer3DModel", **TRANSFORMER.to_diffusers_config()}
    _write_json(directory / "transformer" / "config.json", transformer)
    _save_weights(WanDiT, TRANSFORMER, directory / "transformer" / "diffusion_pytorch_model.safetensors")
    _save_vae(directory / "vae")
    _save_scheduler(directory / "scheduler")
    _write_json(directory / DEFAULTS_FILE, DEFAULTS.to_dict())
    _write_json(directory / MODEL_INDEX, _model_index())
    return directory


def _model_index() -> dict:
    import diffusers

    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }


def seeded_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values for parameter `name`: norm scales near 1, small biases, weights ~ N(0, 1/fan_in)."""
    generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "gamma" or (leaf == "weight" and len(shape) == 1):  # RMSNorm / LayerNorm scales
        return 1.0 + 0.05 * noise
    if leaf == "bias":
        return 0.02 * noise
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    return noise / math.sqrt(fan_in)


def seeded_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """seeded_tensor for every parameter of `module` (which may live on the meta device)."""
    return {name: seeded_tensor(name, tuple(p.shape)) for name, p in module.named_parameters()}


def _save_weights(cls: type[torch.nn.Module], config: object, path: Path) -> None:
    with torch.device("meta"):
        module = cls(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(seeded_state_dict(module), str(path), metadata={"format": "pt"})


def _save_vae(directory: Path) -> None:
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**copy.deepcopy(VAE))  # a copy: the module keeps the lists it is given
    vae.load_state_dict(seeded_state_dict(vae), strict=True)
    vae.save_pretrained(str(directory), safe_serialization=True)


def _save_scheduler(directory: Path) -> None:
    from diffusers import UniPCMultistepScheduler

    UniPCMultistepScheduler(**SCHEDULER).save_pretrained(str(directory))


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _fsync_tree(root: Path) -> None:
    # Data must be on disk before the rename publishes the directory as complete.
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fsync_file(path)


def _remove_stale_builds(cache_dir: Path) -> None:
    # A live build writes a file every few seconds; a temp build in which nothing was written for
    # STALE_BUILD_SECONDS was left by a killed process. The newest mtime of the whole tree counts,
    # not the directory's own, so a slow step inside a live build never makes it look abandoned.
    now = time.time()
    for candidate in cache_dir.glob(f"{BUILDING}*"):
        try:
            newest = max(p.lstat().st_mtime for p in (candidate, *candidate.rglob("*")))
            if now - newest > STALE_BUILD_SECONDS:
                shutil.rmtree(candidate, ignore_errors=True)
        except OSError:
            continue  # another process removed it (or part of it) meanwhile
