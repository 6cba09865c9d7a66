"""The embedded default model: deterministic bytes, atomic publication, an ordinary diffusers directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from mmgen.default_model import (
    BUILDING,
    DEFAULTS,
    NAME,
    STALE_BUILD_SECONDS,
    build_default_model,
    default_cache_dir,
    ensure_default_model,
)
from mmgen.loading.diffusers_dir import load_wan_components, read_model_index


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_two_builds_are_byte_identical(tmp_path, default_model_dir):
    (tmp_path / "again").mkdir()
    build_default_model(tmp_path / "again")
    first, second = _digests(default_model_dir), _digests(tmp_path / "again")
    assert first == second
    assert {"model_index.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json"} <= set(
        first
    )


def test_concurrent_first_uses_publish_one_complete_directory(tmp_path):
    barrier = threading.Barrier(2)
    results: list[Path] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            barrier.wait()
            results.append(ensure_default_model(tmp_path))
        except BaseException as err:  # reported below; a thread must not swallow it
            errors.append(err)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [tmp_path / NAME] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no temp build left behind
    read_model_index(tmp_path / NAME)


def test_half_built_directories_are_never_taken(tmp_path):
    # A build killed five minutes ago (nothing written since) is removed at the next first use; a
    # build whose directory is old but which wrote a file just now is another process still at work.
    killed = tmp_path / f"{BUILDING}killed"
    running = tmp_path / f"{BUILDING}running"
    assert STALE_BUILD_SECONDS < 300
    old = time.time() - 300
    for build in (killed, running):
        (build / "transformer").mkdir(parents=True)
        (build / "transformer" / "config.json").write_text("{}")
        for path in (build / "transformer" / "config.json", build / "transformer", build):
            os.utime(path, (old, old))
    (running / "vae").mkdir()  # written now
    directory = ensure_default_model(tmp_path)
    assert directory == tmp_path / NAME and (directory / "model_index.json").is_file()
    assert not killed.exists() and running.exists()


def test_loads_with_its_defaults_and_as_a_diffusers_pipeline(default_model_dir):
    from diffusers import WanPipeline

    components = load_wan_components(default_model_dir)
    assert components.defaults == DEFAULTS
    assert components.transformer.config.in_channels == components.vae.config.z_dim
    reference = WanPipeline.from_pretrained(default_model_dir)  # an ordinary diffusers directory
    assert type(reference.scheduler).__name__ == "UniPCMultistepScheduler"
    assert reference.scheduler.config.flow_shift == 3.0


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MMGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "mmgen"


@pytest.mark.parametrize("missing", ["model_index.json", "vae", "tokenizer/tokenizer.json"])
def test_missing_parts_are_named(default_model_dir, tmp_path, missing):
    from mmgen.errors import LoadError

    copy = tmp_path / "model"
    shutil.copytree(default_model_dir, copy)
    target = copy / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(LoadError, match=missing.split("/")[-1]):
        load_wan_components(copy)


def test_shipped_weights_are_small_and_checked(tmp_path):
    from mmgen.default_model import MANIFEST, WEIGHT_FILES, shipped_weights
    from mmgen.errors import LoadError

    weights = shipped_weights()
    files = [weights / MANIFEST, *(weights / name for name in WEIGHT_FILES)]
    assert sum(f.stat().st_size for f in files) <= 20 * 2**20
    tampered = tmp_path / "weights"
    shutil.copytree(weights, tampered)
    (tampered / "vae.safetensors").write_bytes(b"not the trained weights")
    (tmp_path / "model").mkdir()
    with pytest.raises(LoadError, match="vae.safetensors: sha256"):
        build_default_model(tmp_path / "model", weights=tampered)


def test_a_damaged_cache_is_rebuilt_not_failing_every_later_run(tmp_path, monkeypatch):
    # Seen: a truncated safetensors file in ~/.cache/mmgen failed every run after it.
    from mmgen.default_model import WEIGHT_FILES, shipped_weights
    from mmgen.families import load_pipeline

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(tmp_path))
    directory = ensure_default_model()
    assert directory == tmp_path / NAME
    transformer = directory / WEIGHT_FILES["transformer.safetensors"]
    transformer.write_bytes(transformer.read_bytes()[:1000])  # a truncated copy
    (directory / WEIGHT_FILES["vae.safetensors"]).unlink()  # and a lost one
    pipe = load_pipeline(None, task="t2v", device="cpu", dtype="float32")  # `mmgen generate` without --model
    assert pipe.transformer.config.num_layers == 4
    for name, target in WEIGHT_FILES.items():
        assert (directory / target).read_bytes() == (shipped_weights() / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # the damaged copy is gone too


def test_vae_and_scheduler_configs_are_what_diffusers_writes(default_model_dir, tmp_path):
    # The build writes them without importing diffusers (the first run's start); diffusers' own
    # writers must give the same files, so the directory stays an ordinary diffusers directory.
    import json

    diffusers = pytest.importorskip("diffusers")
    from mmgen.default_model import SCHEDULER, VAE

    built_vae = json.loads((default_model_dir / "vae" / "config.json").read_text())
    stats = {key: built_vae[key] for key in ("latents_mean", "latents_std")}
    with torch.device("meta"):
        diffusers.AutoencoderKLWan(**VAE, **stats).save_config(str(tmp_path / "vae"))
    diffusers.UniPCMultistepScheduler(**SCHEDULER).save_pretrained(str(tmp_path / "scheduler"))
    for name in ("vae/config.json", "scheduler/scheduler_config.json"):
        assert (tmp_path / name).read_bytes() == (default_model_dir / name).read_bytes(), name
