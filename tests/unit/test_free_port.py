"""``helpers.free_port``: ports the tests hand to processes that bind them later (a vLLM worker's
metrics port, 40 s after it is picked) come from below the kernel's ephemeral range, where no
outgoing connection takes them meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import helpers
import pytest
from helpers import ephemeral_ports, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, _ = ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert 10_000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_the_ephemeral_range_is_read_from_the_kernel_or_linuxs_default(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    assert ephemeral_ports(str(ranges)) == (40000, 50000)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    ranges.write_text("garbage\n")
    assert ephemeral_ports(str(ranges)) == (32768, 60999)


def test_with_no_room_below_the_range_the_os_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "ephemeral_ports", lambda: (10_500, 60_999))
    port = free_port()
    assert port >= 10_500  # the OS's pick, from the (pretended) ephemeral range or above
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
