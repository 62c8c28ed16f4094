"""Helpers for the kvflow-ucx tests: peer processes (spawned) and the skip marker.

Named ``ucx_testlib`` (not ``conftest``/``_peer``) so that it never clashes with other test
directories collected in the same pytest session.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import select
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from kvflow._proc import stop_child

from kvflow_ucx import UcxTransport

REASON = UcxTransport.unavailable_reason()
requires_ucx = pytest.mark.skipif(REASON is not None, reason=f"ucx unavailable: {REASON}")

#: UCX_TLS settings the suites run under: TCP, and shared memory (CMA for RMA).
TLS_PARAMS = [pytest.param("tcp", id="tcp"), pytest.param("sm", id="sm")]


def native_peer(conn: Connection, nbytes: int, seed: int, config: dict[str, str]) -> None:
    """A process with a UCX worker and a mapped buffer of random bytes, driven over ``conn``.

    Sends {address, rkey, addr, pid}; receives this side's worker address; then progresses its
    worker whenever the event fd fires, answering ("bytes",) and ("stop",)."""
    from kvflow_ucx import _lowlevel as ll

    w = ll.Worker(config)
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    m = w.mem_map(int(buf.ctypes.data), nbytes)
    conn.send({"address": w.address, "rkey": m.rkey, "addr": int(buf.ctypes.data), "pid": os.getpid()})
    ep = w.connect(conn.recv())
    while True:
        w.progress()
        if w.arm() == ll.UCS_OK:
            select.select([w.efd, conn.fileno()], [], [], 1.0)
        if conn.poll(0):
            cmd = conn.recv()
            if cmd == "bytes":
                conn.send(buf.tobytes())
            else:
                break
    del ep
    conn.send("bye")


class NativePeer:
    """A spawned :func:`native_peer`; every wait is bounded."""

    def __init__(self, nbytes: int, seed: int, config: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=native_peer, args=(child, nbytes, seed, config), daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = self.recv()

    def recv(self, timeout: float = 30.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("native peer did not answer")
        return self.conn.recv()

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def stop(self) -> None:
        stop_child(self.proc, self.conn)


async def datadist_peer(conn: Connection) -> None:
    """A PeerProcess main: an LlmDataDist (cluster 1) serving one random cache over ucx."""
    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole
    from kvflow._proc import recv_from_parent

    args = conn.recv()
    desc = CacheDesc(num_tensors=args["tensors"], data_type=DataType.DT_UINT8, shape=args["shape"])
    rng = np.random.default_rng(args.get("seed", 3))
    bufs = [rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for _ in range(desc.num_tensors)]
    async with LlmDataDist(1, LlmRole.PROMPT, options=args["options"]) as dd:
        cache = await dd.register_kv_cache(desc, bufs)
        assert dd.listen_address is not None
        conn.send({"port": dd.listen_address[1], "cache_id": cache.cache_id, "pid": os.getpid()})
        while True:
            cmd = await recv_from_parent(conn)
            if cmd == "bytes":
                conn.send([b.tobytes() for b in bufs])
            else:
                break
    await asyncio.sleep(0)


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
