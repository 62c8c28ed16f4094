"""kvflow's pytest plugin (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
