"""A local Ray cluster for the tests that need one (render, serve and replicas on Ray)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import ray


@contextlib.contextmanager
def local_ray_cluster(
    environment: Mapping[str, str] = {}, *, runtime_env: dict[str, Any] | None = None
) -> Iterator[str]:
    """A new Ray cluster of 2 CPUs on loopback; yields its GCS address and shuts it down even on failure.

    address "local": a new cluster here, never one a stale ray_current_cluster file names.
    environment: set while the raylet starts, so its workers (also other drivers' joining it) inherit
    it; runtime_env: Ray's, for this driver's workers only.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            **({} if runtime_env is None else {"runtime_env": runtime_env}),
        )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
