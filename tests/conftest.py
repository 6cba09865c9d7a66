"""Shared test setup: one torch thread per test process, and the embedded default model.

Threads: CI runs `pytest -n 2` on 2 cores. With torch's default of one thread per core, the two
workers oversubscribe the cores and OpenMP's spinning threads make small CPU kernels (the tiny VAE
decode) 10-20x slower. So unless OMP_NUM_THREADS is set, every test process and the subprocesses
tests start (they inherit the variable) use one thread.

Fixtures: `mmgen_cache_dir` is a fresh cache directory holding the built default model (pass it to
a subprocess as MMGEN_CACHE_DIR); `default_model_dir` is the model directory inside it. Both are
session-scoped: built once per test process (each pytest-xdist worker builds its own, ~1 s).
`qwen_image_dir` is a tiny random Qwen-Image directory, written once per test process too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from qwen_image_cases import write_qwen_image_dir


def pytest_configure(config: pytest.Config) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def mmgen_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmgen.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("mmgen-cache")
    ensure_default_model(cache)
    return cache


@pytest.fixture(scope="session")
def default_model_dir(mmgen_cache_dir: Path) -> Path:
    from mmgen.default_model import ensure_default_model

    return ensure_default_model(mmgen_cache_dir)


@pytest.fixture(scope="session")
def qwen_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen-Image directory (tests/qwen_image_cases.py), written once per session: the
    tests only read it (each module loads its own pipeline from it)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    return write_qwen_image_dir(tmp_path_factory.mktemp("qwen"))
