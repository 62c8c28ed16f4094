"""A peer process for the two-process tests: it holds buffers and answers commands over a pipe."""

from __future__ import annotations

import ctypes
import mmap
import os
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE


def addr_of(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def serve(conn: Connection, nbytes: int, seed: int) -> None:
    """Own a buffer of ``nbytes`` random bytes and a two-page map whose second page is PROT_NONE.

    Commands: ("bytes",) -> buffer contents; ("fill", value); ("read", pid, addr, n) -> bytes read
    from another process (or the exception); ("setuid", uid); ("exit",)."""
    from kvflow import LLMException

    from kvflow_shm import _lowlevel as ll

    assert ll.native_error() is None  # load it now: after setuid the files may be unreadable
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    guard = mmap.mmap(-1, 2 * PAGE)
    gaddr = ctypes.addressof(ctypes.c_char.from_buffer(guard))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(gaddr + PAGE, PAGE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    conn.send({"pid": os.getpid(), "addr": addr_of(buf), "nbytes": nbytes, "guard": gaddr})
    while True:
        if not conn.poll(60):
            return
        cmd: Any = conn.recv()
        if cmd[0] == "bytes":
            conn.send(buf.tobytes())
        elif cmd[0] == "fill":
            buf[:] = cmd[1]
            conn.send(True)
        elif cmd[0] == "read":
            try:
                conn.send(ll.probe_read(cmd[1], cmd[2], cmd[3]))
            except LLMException as exc:
                conn.send(exc)
        elif cmd[0] == "setuid":
            os.setgid(cmd[1])
            os.setuid(cmd[1])
            conn.send(True)
        else:
            conn.send(True)
            return


def serve_datadist(conn: Connection, options: dict[str, str], seed: int) -> None:
    """Run an LlmDataDist (cluster 1) holding one random cache; answer ("contents",) and ("exit",)."""
    import asyncio

    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole

    async def main() -> None:
        loop = asyncio.get_running_loop()
        opts = {"llm.ListenIpInfo": "127.0.0.1:0", **options}
        async with LlmDataDist(1, LlmRole.PROMPT, options=opts) as dd:
            desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[64, 16384])
            rng = np.random.default_rng(seed)
            tensors = [rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
            cache = await dd.register_kv_cache(desc, tensors)
            assert dd.listen_address is not None
            conn.send({"pid": os.getpid(), "port": dd.listen_address[1], "cache_id": cache.cache_id})
            while True:
                if not await loop.run_in_executor(None, conn.poll, 60):
                    return
                cmd = conn.recv()
                if cmd[0] == "contents":
                    conn.send([t.tobytes() for t in tensors])
                else:
                    conn.send(True)
                    return

    asyncio.run(main())



def serve_faulting(conn: Connection, nbytes: int) -> None:
    """Own ``nbytes`` of ``kvflow.testing.FaultingMemory``: a copy from them stalls inside
    ``process_vm_readv`` until told ("resolve", value), which fills every page with ``value``.
    Sends {"error": ...} instead where userfaultfd is not allowed."""
    from kvflow.testing import FaultingMemory

    try:
        mem = FaultingMemory(nbytes)
    except OSError as exc:
        conn.send({"error": str(exc)})
        return
    conn.send({"pid": os.getpid(), "addr": mem.addr, "nbytes": nbytes})
    while conn.poll(60):
        cmd = conn.recv()
        if cmd[0] != "resolve":
            return
        conn.send(mem.resolve(cmd[1]))
