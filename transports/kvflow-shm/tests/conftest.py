from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import _peer
import pytest
from kvflow._proc import stop_child

from kvflow_shm import ShmTransport

REASON = ShmTransport.unavailable_reason()
requires_cma = pytest.mark.skipif(REASON is not None, reason=f"shm unavailable: {REASON}")


class Peer:
    """A spawned process running ``_peer.serve``; every wait on it is bounded."""

    def __init__(self, nbytes: int = 1 << 20, seed: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer.serve, args=(child, nbytes, seed), daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = self.recv()
        self.pid: int = self.info["pid"]
        self.addr: int = self.info["addr"]
        self.nbytes: int = self.info["nbytes"]

    def recv(self, timeout: float = 30) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("peer process did not answer")
        return self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv()

    def contents(self) -> bytes:
        return self.call("bytes")

    def stop(self) -> None:
        stop_child(self.proc, self.conn, ("exit",))


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.stop()
