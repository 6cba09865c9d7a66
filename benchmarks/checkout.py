"""This checkout for a benchmark's child processes (servers, ranks, Ray replicas, fresh interpreters):
the PYTHONPATH that puts it first. Imports nothing heavy: the start-up benchmarks time their imports."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_pythonpath(root: Path = ROOT) -> str:
    """PYTHONPATH with this checkout (or another tree at `root`) first, then what it held (e.g. the GPU
    bundles), so a child runs that tree's mmgen."""
    return os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
