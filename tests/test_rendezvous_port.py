"""mmgen.parallel.process.free_port: a world's rendezvous port, drawn below the kernel's ephemeral range
(a port from that range may become an outgoing connection's source port before the store listens)."""

from __future__ import annotations

import socket

from mmgen.parallel.process import RENDEZVOUS_PORTS, free_port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_port_is_below_the_ephemeral_range_and_free(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    ports = {free_port(str(ranges)) for _ in range(8)}
    assert all(40000 - RENDEZVOUS_PORTS <= port < 40000 and _bindable(port) for port in ports)
    assert len(ports) > 1  # drawn, not a fixed port two worlds would share


def test_a_taken_port_is_passed_over(tmp_path, monkeypatch):
    """The window holds one port, held here: free_port gives another (bind checked, not assumed)."""
    from mmgen.parallel import process

    ranges = tmp_path / "ip_local_port_range"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        ranges.write_text(f"{taken + 1} 60999")
        monkeypatch.setattr(process, "RENDEZVOUS_PORTS", 1)
        port = free_port(str(ranges))
        assert port != taken and _bindable(port)


def test_without_the_range_any_free_port(tmp_path):
    port = free_port(str(tmp_path / "absent"))
    assert 0 < port < 65536 and _bindable(port)
