"""Reaching a Ray cluster is bounded and every refusal is one line (mmgen.executors.ray_cluster): an
address nothing answers at, and a stale ray_current_cluster file left by a dead `ray start`, end
`mmgen render --ray` within seconds; 'auto' devices follow what the cluster has; a cluster too small
for the replicas asked is refused before anything is placed, naming what is missing. No cluster is
started here (tests/test_render_ray.py runs replicas on one)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mmgen.errors import MmgenError
from mmgen.executors.ray_cluster import (
    HTTP2_PREFACE,
    PROBE_TIMEOUT_S,
    check_fit,
    cluster_address,
    device_of,
    host_port,
    probe,
)

ROOT = Path(__file__).resolve().parents[1]
BATCH = """\
    model: default
    defaults: {height: 16, width: 16, num_frames: 1, num_inference_steps: 1}
    jobs:
      - {name: a, prompt: a cat, seed: 1}
"""


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_auto_reads_ray_address_then_the_file_and_a_stale_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(MmgenError, match=r"^--ray auto: no running Ray cluster found .*ray start --head"):
        cluster_address("auto")
    stale = f"127.0.0.1:{closed_port()}"
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(stale + "\n")
    address, source = cluster_address("auto")
    assert (address, source) == (stale, str(tmp_path / "ray" / "ray_current_cluster"))
    start = time.monotonic()
    with pytest.raises(MmgenError, match=r"recorded in .*ray_current_cluster .*a stale file") as err:
        probe(address, source)
    assert time.monotonic() - start < 10 and "\n" not in str(err.value)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the environment wins over the file
    assert cluster_address("auto") == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert cluster_address("ray://h:10001") == ("ray://h:10001", "--ray")
    assert host_port("ray://h:10001") == ("h", 10001) and host_port("[::1]:6379") == ("::1", 6379)
    with pytest.raises(MmgenError, match=r"^--ray nowhere: not a cluster address"):
        probe("nowhere", "--ray")


def test_auto_device_follows_the_cluster_and_a_small_cluster_is_refused_naming_what_is_missing():
    cpu_only = [{"CPU": 2.0}]
    assert device_of("auto", cpu_only) == "cpu" and device_of("auto", [{"CPU": 8.0, "GPU": 1.0}]) == "cuda"
    assert device_of("cuda", cpu_only) == "cuda"  # asked for: kept (check_fit then names the GPU)
    check_fit(cpu_only, replicas=2, ranks=1, cpus=1.0, gpus=0.0)
    with pytest.raises(MmgenError, match=r"room for 0 of 1 replicas: a replica needs 1 CPU \+ 1 GPU"):
        check_fit(cpu_only, replicas=1, ranks=1, cpus=1.0, gpus=1.0)
    with pytest.raises(MmgenError, match=r"room for 2 of 3 replicas: .*; its nodes have 2 CPU, 0 GPU$"):
        check_fit(cpu_only, replicas=3, ranks=1, cpus=1.0, gpus=0.0)
    # a replica's ranks share one node: two 2-CPU nodes cannot hold a 4-rank replica
    with pytest.raises(
        MmgenError, match=r"room for 0 of 1 replicas: a replica needs 4 CPU on one node \(4 ranks\)"
    ):
        check_fit([{"CPU": 2.0}, {"CPU": 2.0}], replicas=1, ranks=4, cpus=1.0, gpus=0.0)


def render_with(tmp_path: Path, ray: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    config = tmp_path / "batch.yaml"
    config.write_text(textwrap.dedent(BATCH))
    command = [sys.executable, "-m", "mmgen.cli", "render", str(config), "--out", str(tmp_path / "out")]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "MMGEN_CACHE_DIR": str(cache), **env}
    environment.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [*command, "--no-progress", "--ray", ray], env=environment, capture_output=True, text=True, timeout=60
    )


def test_render_on_an_unreachable_address_is_one_line_within_a_minute(tmp_path, mmgen_cache_dir):
    start = time.monotonic()
    done = render_with(tmp_path, "127.0.0.1:1", mmgen_cache_dir)
    assert time.monotonic() - start < 60
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "mmgen: error: --ray 127.0.0.1:1: no Ray cluster answers there (from --ray; Connection refused within 5s)"
    ]


def test_render_auto_with_a_stale_cluster_file_is_one_line(tmp_path, mmgen_cache_dir):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{closed_port()}")
    done = render_with(tmp_path, "auto", mmgen_cache_dir, RAY_TMPDIR=str(tmp_path))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("mmgen: error: --ray auto: the cluster recorded in ") and "a stale file" in line


@contextmanager
def listening(answer: bytes | None) -> Iterator[int]:
    """A loopback port where a server accepts every connection, reads what comes and writes `answer`
    once (None: nothing, ever) while the connection stays open; its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop, held = threading.Event(), []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if answer is not None:
                conn.recv(len(HTTP2_PREFACE))
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def test_a_port_where_something_else_listens_is_not_a_cluster():
    # a gRPC server's first frame: SETTINGS (type 4), here with no settings
    with listening(bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))) as port:
        probe(f"127.0.0.1:{port}", "--ray")
    for answer in (b"HTTP/1.1 400 Bad Request\r\n\r\n", None):
        with listening(answer) as port:
            start = time.monotonic()
            with pytest.raises(MmgenError, match="does not answer as a Ray cluster") as err:
                probe(f"127.0.0.1:{port}", "--ray")
            assert time.monotonic() - start < PROBE_TIMEOUT_S + 2 and "\n" not in str(err.value)


def test_render_on_a_port_that_is_no_ray_cluster_is_one_line_within_30_seconds(tmp_path, mmgen_cache_dir):
    # ray.init alone retried such an address for minutes, printing Ray's GCS warnings
    with listening(None) as port:
        start = time.monotonic()
        done = render_with(tmp_path, f"127.0.0.1:{port}", mmgen_cache_dir)
        assert time.monotonic() - start < 30
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"mmgen: error: --ray 127.0.0.1:{port}: no Ray cluster answers there (from --ray; something listens "
        "there but does not answer as a Ray cluster (gRPC) within 5s)"
    ]


def test_serve_on_an_unreachable_address_is_one_line_before_it_listens(tmp_path):
    pytest.importorskip("fastapi")
    command = [sys.executable, "-m", "mmgen.cli", "serve", "--port", "0", "--state", str(tmp_path / "state")]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "MMGEN_CACHE_DIR": str(tmp_path / "cache")}
    start = time.monotonic()
    done = subprocess.run(
        [*command, "--ray", "127.0.0.1:1"], env=environment, capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 30
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)  # never listened
    assert done.stderr.splitlines() == [
        "mmgen: error: --ray 127.0.0.1:1: no Ray cluster answers there (from --ray; Connection refused within 5s)"
    ]
    assert not (tmp_path / "state").exists() and not (tmp_path / "cache").exists()  # nothing built
