"""The embedded default model: a tiny Wan-architecture checkpoint trained on a toy world, shipped as package data.

`ensure_default_model()` returns a cache directory holding an ordinary diffusers-format Wan
directory (model_index.json, transformer/, text_encoder/, tokenizer/, vae/, scheduler/), so
`mmgen generate` without --model runs the real loading path. The weights are trained by
`python3 -m pipelines.tiny_world.train` (see pipelines/tiny_world/) on clips of one shape in a named colour moving in a
named direction over a plain background ("a red circle moves left on a black background"); they
ship in mmgen/tiny/weights/ (three safetensors files and model.json, which records the latent
statistics, the weights' sha256 and the training run). Generation defaults (48x48, 9 frames, 8
fps, steps and guidance as below) are what the model was trained and checked for; they go into the
directory's mmgen_defaults.json.

The architecture constants below are the single source for both the trainer and this builder.
The directory is written under a temp name and renamed into place once complete, so a concurrent
first use or a killed build never leaves a half-built directory under the final name.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

from mmgen.errors import LoadError
from mmgen.loading.diffusers_dir import MODEL_INDEX
from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
from mmgen.loading.wan_components import DEFAULTS_FILE, GenerationDefaults
from mmgen.models.umt5 import UMT5Config
from mmgen.models.wan import WanConfig
from mmgen.models.wan_vae import CLASS_NAME as VAE_CLASS_NAME
from mmgen.models.wan_vae import ENCODER_ONLY
from mmgen.models.wan_vae import read_config as read_vae_config
from mmgen.outputs.writers import file_sha256, fsync_file
from mmgen.schedulers.unipc_flow import CLASS_NAME as SCHEDULER_CLASS_NAME
from mmgen.schedulers.unipc_flow import FlowUniPCScheduler

NAME = "wan-tiny-v4"  # bump the version whenever anything below or the shipped weights change the built bytes
BUILDING = f".{NAME}.building-"
STALE_BUILD_SECONDS = 120  # a temp build with nothing written for this long was left by a killed process

DEFAULTS = GenerationDefaults(
    height=48, width=48, num_frames=9, num_inference_steps=12, guidance_scale=4.0, negative_prompt="", fps=8
)
Z_DIM = 8
TEXT_DIM = 64
TRANSFORMER = WanConfig(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=TEXT_DIM,
    freq_dim=64,
    ffn_dim=384,
    num_layers=4,
)
# AutoencoderKLWan with two down/up stages: 4x spatial and 2x temporal compression (the second stage only),
# so 9 frames of 48x48 are 5 x 12 x 12 latents: five positions of the moving shape instead of the three a
# 4x temporal VAE keeps, which is what lets the DiT learn the direction words. latents_mean/std come from the trained weights' model.json.
VAE = {
    "base_dim": 16,
    "z_dim": Z_DIM,
    "dim_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True],
    "scale_factor_spatial": 4,
    "scale_factor_temporal": 2,
}
SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
# The tokenizer's whole words (the toy world's vocabulary); other words split into known characters.
WORDS = tuple(
    "a moves stays on background circle square triangle star red yellow green cyan blue purple "
    "black gray white left right up down still".split()
)
# The shipped files: weights/<name>.safetensors -> <component>/<file> in the diffusers directory.
WEIGHT_FILES = {
    "transformer.safetensors": "transformer/diffusion_pytorch_model.safetensors",
    "text_encoder.safetensors": "text_encoder/model.safetensors",
    "vae.safetensors": "vae/diffusion_pytorch_model.safetensors",
}
MANIFEST = "model.json"


def text_encoder_config(vocab_size: int) -> UMT5Config:
    """The tiny UMT5's shape; the vocabulary is padded up to a multiple of 64, as T5 checkpoints pad it."""
    return UMT5Config(
        vocab_size=64 * math.ceil(vocab_size / 64),
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
    )


def shipped_weights() -> Path:
    """The package-data directory holding the trained weights (mmgen/tiny/weights)."""
    return Path(str(resources.files("mmgen") / "tiny" / "weights"))


def default_cache_dir() -> Path:
    """$MMGEN_CACHE_DIR, else $XDG_CACHE_HOME/mmgen, else ~/.cache/mmgen."""
    if os.environ.get("MMGEN_CACHE_DIR"):
        return Path(os.environ["MMGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmgen"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The embedded default model's directory, building it first if the cache does not hold it yet,
    or holds it with weight files that differ from the shipped ones (rebuilt then)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / NAME
    if final.is_dir() and not damaged_files(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir)
    temp = Path(tempfile.mkdtemp(prefix=BUILDING, dir=cache_dir))
    try:
        build_default_model(temp)
        _fsync_tree(temp)
        _set_aside(final)  # a damaged copy (a rename cannot replace a non-empty directory)
        try:
            os.rename(temp, final)
        except OSError:
            if not final.is_dir():  # not "another process finished first": a real failure
                raise
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
    return final


def damaged_files(directory: Path) -> list[Path]:
    """The weight files of a built directory that are missing or differ from the shipped sha256
    (a truncated copy, a disk error): the cache is rebuilt rather than failing every later run."""
    shipped = json.loads((shipped_weights() / MANIFEST).read_text())["sha256"]
    damaged = []
    for name, target in WEIGHT_FILES.items():
        file = Path(directory) / target
        if not file.is_file() or file_sha256(file) != shipped[name]:
            damaged.append(file)
    return damaged


def _set_aside(final: Path) -> None:
    # Renamed under the build prefix first, so a kill during the removal leaves a stale build that
    # the next run deletes, never a damaged directory under the final name.
    aside = final.with_name(f"{BUILDING}damaged-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return  # nothing there, or another process set it aside first
    shutil.rmtree(aside, ignore_errors=True)


def build_default_model(directory: Path, *, weights: Path | None = None) -> Path:
    """Write the diffusers-format directory into `directory` (which must exist) from the trained weights.

    `weights`: a directory as `python3 -m pipelines.tiny_world.train --out` writes it; the shipped one by default.
    The same bytes every time for the same weights.
    """
    directory = Path(directory)
    weights = shipped_weights() if weights is None else Path(weights)
    manifest = _read_manifest(weights)
    build_word_tokenizer(list(WORDS), directory / "tokenizer", model_max_length=TRANSFORMER.text_len)
    vocab = TextTokenizer.from_dir(directory / "tokenizer").vocab_size
    _write_json(directory / "text_encoder" / "config.json", text_encoder_config(vocab).to_hf_config())
    transformer = {"_class_name": "WanTransformer3DModel", **TRANSFORMER.to_diffusers_config()}
    _write_json(directory / "transformer" / "config.json", transformer)
    _save_vae_config(directory / "vae", manifest["latents_mean"], manifest["latents_std"])
    for name, target in WEIGHT_FILES.items():
        (directory / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights / name, directory / target)
    _save_scheduler(directory / "scheduler")
    _write_json(directory / DEFAULTS_FILE, DEFAULTS.to_dict())
    _write_json(directory / MODEL_INDEX, _model_index())
    return directory


def _read_manifest(weights: Path) -> dict:
    """model.json of a weights directory, with every weight file checked against its recorded sha256."""
    path = weights / MANIFEST
    if not path.is_file():
        raise LoadError(f"{path}: the default model's weights manifest is missing (reinstall mmgen)")
    manifest = json.loads(path.read_text())
    for name in WEIGHT_FILES:
        file = weights / name
        if not file.is_file():
            raise LoadError(f"{file}: a default model weight file is missing (reinstall mmgen)")
        digest = file_sha256(file)
        if digest != manifest["sha256"][name]:
            raise LoadError(f"{file}: sha256 {digest} differs from {path}'s {manifest['sha256'][name]}")
    for key in ("latents_mean", "latents_std"):
        if len(manifest.get(key, ())) != Z_DIM:
            raise LoadError(f"{path}: {key} must hold {Z_DIM} numbers")
    return manifest


def _model_index() -> dict:
    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": _diffusers_version(),
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }


def _diffusers_version() -> str:
    # The installed diffusers' version, as its own writers record it; read from the package metadata,
    # not by importing diffusers (~2 s): the first run builds this directory.
    return importlib.metadata.version("diffusers")


def _save_vae_config(directory: Path, latents_mean: list[float], latents_std: list[float]) -> None:
    # What AutoencoderKLWan.save_config writes (tests/test_default_model.py compares them).
    config = read_vae_config({**VAE, "latents_mean": latents_mean, "latents_std": latents_std})
    encoder = {key: VAE[key] for key in ENCODER_ONLY if key in VAE}
    header = {"_class_name": VAE_CLASS_NAME, "_diffusers_version": _diffusers_version()}
    _write_json(directory / "config.json", {**header, **config.to_diffusers(**encoder)})


def _save_scheduler(directory: Path) -> None:
    # What UniPCMultistepScheduler(**SCHEDULER).save_pretrained writes (tests/test_default_model.py).
    config = FlowUniPCScheduler.from_config({**SCHEDULER, "use_flow_sigmas": True}).config
    header = {"_class_name": SCHEDULER_CLASS_NAME, "_diffusers_version": _diffusers_version()}
    _write_json(directory / "scheduler_config.json", {**header, **config.to_diffusers()})


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
