"""The Ray cluster a RayExecutor uses: found and reached within seconds, and asked what it has.

Every wait here is bounded and every refusal is one line:
- `cluster_address`: which cluster `--ray auto|HOST:PORT|ray://HOST:PORT` means. 'auto' is
  RAY_ADDRESS, else the address the last `ray start` on this machine left in Ray's temp folder
  (RAY_TMPDIR / TMPDIR / /tmp, then ray/ray_current_cluster).
- `probe`: that address answers a TCP connect, then HTTP/2's connection preface as a gRPC server
  does (Ray's GCS and its client server are gRPC), each within PROBE_TIMEOUT_S, before ray.init
  (which otherwise retries a dead address, or a port where something else listens, for minutes); a
  file left by a `ray start` whose processes died is named as such, never joined.
- `device_of`: the device 'auto' means on this cluster (cuda when a node has a GPU, else cpu), so
  a CPU-only cluster never waits for GPUs it does not have.
- `check_fit`: the cluster's nodes can hold every replica (each replica's ranks on one node) before
  anything is placed; else one line naming what is missing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from mmgen.errors import MmgenError

PROBE_TIMEOUT_S = 5.0
# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server answers with its own
# SETTINGS frame (9-byte frame header, type 4) at once. Ray's GCS did within a millisecond here.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))
HTTP2_SETTINGS = 4
ADDRESS_FILE = "ray_current_cluster"


def address_file() -> Path:
    """Where `ray start` records the cluster it started (the folder Ray itself reads)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(temp) / "ray" / ADDRESS_FILE


def cluster_address(address: str) -> tuple[str, str]:
    """(the cluster address for ray.init, where it came from: '--ray', 'RAY_ADDRESS' or the file)."""
    if address != "auto":
        return address, "--ray"
    given = os.environ.get("RAY_ADDRESS", "").strip()
    if given:
        return given, "RAY_ADDRESS"
    file = address_file()
    try:
        found = file.read_text().strip()
    except OSError:
        found = ""
    if not found:
        raise MmgenError(
            f"--ray auto: no running Ray cluster found (RAY_ADDRESS is unset and {file} does not exist): "
            "start one with `ray start --head`, or give its address"
        )
    return found, str(file)


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of 'HOST:PORT' or 'ray://HOST:PORT' ([v6] hosts too); None when it names no port."""
    text = address.split("://", 1)[-1].rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe(address: str, source: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """One line, within timeout_s, when nothing answers at `address` (found at `source`)."""
    where = host_port(address)
    if where is None:
        raise MmgenError(f"--ray {address}: not a cluster address; use auto, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection(where, timeout=timeout_s) as sock:
            if not _answers_grpc(sock):
                raise OSError("something listens there but does not answer as a Ray cluster (gRPC)")
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        if source not in ("--ray", "RAY_ADDRESS"):
            raise MmgenError(
                f"--ray auto: the cluster recorded in {source} ({address}) does not answer ({reason}): "
                "a stale file left by a `ray start` whose processes died; start a cluster "
                "(`ray start --head`) or give its address"
            ) from None
        raise MmgenError(
            f"--ray {address}: no Ray cluster answers there (from {source}; {reason} within {timeout_s:g}s)"
        ) from None


def _answers_grpc(sock: socket.socket) -> bool:
    """Whether the server on `sock` answers HTTP/2's preface with a SETTINGS frame within the socket's
    timeout. A cluster with TLS (RAY_USE_TLS) would need a handshake first: not probed."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    head = b""
    try:
        sock.sendall(HTTP2_PREFACE)
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:  # closed: not an HTTP/2 server
                return False
            head += chunk
    except TimeoutError:
        return False
    return head[3] == HTTP2_SETTINGS


def device_of(device: str, nodes: Sequence[Mapping[str, float]]) -> str:
    """`device` with 'auto' resolved for the cluster: 'cuda' when any node has a GPU, else 'cpu'."""
    if device != "auto":
        return device
    return "cuda" if any(node.get("GPU", 0.0) > 0 for node in nodes) else "cpu"


def check_fit(
    nodes: Sequence[Mapping[str, float]], replicas: int, ranks: int, cpus: float, gpus: float
) -> None:
    """One line naming what is missing when `replicas` replicas of `ranks` ranks (each rank `cpus`
    CPUs and `gpus` GPUs, a replica's ranks packed on one node) cannot all be placed on `nodes`
    (each node's total resources)."""
    need = {"CPU": ranks * cpus, "GPU": ranks * gpus}
    fits = sum(_replicas_on(node, need) for node in nodes)
    if fits >= replicas:
        return
    one = " + ".join(f"{amount:g} {name}" for name, amount in need.items() if amount)
    have = "; ".join(
        ", ".join(f"{node.get(name, 0.0):g} {name}" for name in ("CPU", "GPU")) for node in nodes
    )
    what = f"a replica needs {one} on one node ({ranks} rank{'s' if ranks != 1 else ''})"
    raise MmgenError(
        f"Ray cluster: room for {fits} of {replicas} replicas: {what}; its nodes have {have or 'nothing'}"
    )


def _replicas_on(node: Mapping[str, float], need: Mapping[str, float]) -> int:
    counts = [int(node.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0]
    return min(counts) if counts else 1 << 30  # a replica that asks for nothing fits anywhere
