"""Raw ``process_vm_readv`` baseline: what the syscall alone does between two processes.

``kvflow bench`` puts these rows beside the shm transport's, so the transport's overhead is
visible. Run ``python -m kvflow_shm.bench`` for a table.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from kvflow.transport import stop_child

from . import _lowlevel as ll

__all__ = ["BASELINE_NAME", "RawBaseline", "baseline", "raw_readv", "shm_vs_raw"]


def _hold(conn: Connection, nbytes: int) -> None:
    """Peer process: own ``nbytes`` of touched memory until told to stop (or 10 minutes pass)."""
    buf = np.ones(nbytes, dtype=np.uint8)
    conn.send((os.getpid(), int(buf.ctypes.data)))
    conn.poll(600)


def raw_readv(nbytes: int, block_size: int, *, iters: int = 200, scattered: bool = True,
              write: bool = False, seed: int = 0) -> dict[str, Any]:
    """Time moving ``nbytes`` in ``block_size`` runs from (``write``: to) a spawned peer process.

    Each iteration is one call of the native copy loop with prebuilt arguments (``IOV_MAX``-sized
    syscall batches, GIL released), so only the syscalls are timed; ``scattered`` shuffles the blocks on both sides. Returns
    ``{"nbytes", "block_size", "runs", "iters", "p50_us", "p90_us", "gbps"}`` (``gbps``: GB/s at p50).
    """
    if block_size <= 0 or nbytes < block_size or nbytes % block_size:
        raise ValueError("nbytes must be a positive multiple of block_size")
    reason = ll.native_error()
    if reason:
        raise RuntimeError(reason)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold, args=(child, nbytes), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(60):
            raise TimeoutError("benchmark peer did not start")
        pid, remote_base = parent.recv()
        local = np.ones(nbytes, dtype=np.uint8)
        n = nbytes // block_size
        rng = np.random.default_rng(seed)
        lo = rng.permutation(n) if scattered else np.arange(n)
        ro = rng.permutation(n) if scattered else np.arange(n)
        la = np.uint64(local.ctypes.data) + lo.astype(np.uint64) * np.uint64(block_size)
        ra = np.uint64(remote_base) + ro.astype(np.uint64) * np.uint64(block_size)
        lens = np.full(n, block_size, dtype=np.uint64)
        ll.vm_copy(pid, write, la, ra, lens)  # fail here, with a typed error, if it cannot work
        ffi, lib = ll._native()
        args = (pid, 1 if write else 0, ffi.from_buffer("uint64_t[]", la), ffi.from_buffer("uint64_t[]", ra),
                ffi.from_buffer("uint64_t[]", lens), n, ll.MAX_CHUNK, ffi.NULL, ffi.new("uint64_t *"))
        copy = lib.kvf_vm_copy
        for _ in range(max(3, iters // 20)):  # warm up
            copy(*args)
        times = np.empty(iters)
        clock = time.perf_counter
        for i in range(iters):
            t0 = clock()
            copy(*args)
            times[i] = clock() - t0
    finally:
        stop_child(proc, parent)
    p50 = float(np.percentile(times, 50))
    return {"nbytes": nbytes, "block_size": block_size, "runs": n, "iters": iters,
            "p50_us": p50 * 1e6, "p90_us": float(np.percentile(times, 90)) * 1e6, "gbps": nbytes / p50 / 1e9}


#: How ``kvflow bench`` labels the rows of :func:`baseline`.
BASELINE_NAME = "raw process_vm_readv/writev"
_GIB = 1 << 30


class RawBaseline:
    """Raw copies between ``buf`` here and ``remote_addr`` in process ``pid`` (``kvflow bench``'s baseline)."""

    def __init__(self, pid: int, buf: np.ndarray, repeat: int, remote_addr: int) -> None:
        reason = ll.native_error()
        if reason:
            raise RuntimeError(reason)
        self.pid, self.buf, self.repeat, self.remote = pid, buf, max(1, repeat), remote_addr

    def _args(self, nbytes: int, block: int, write: bool, scattered: bool) -> tuple[Any, ...]:
        n = nbytes // block
        rng = np.random.default_rng(0)
        lo = rng.permutation(n) if scattered else np.arange(n)
        ro = rng.permutation(n) if scattered else np.arange(n)
        la = np.uint64(self.buf.ctypes.data) + lo.astype(np.uint64) * np.uint64(block)
        ra = np.uint64(self.remote) + ro.astype(np.uint64) * np.uint64(block)
        lens = np.full(n, block, dtype=np.uint64)
        ll.vm_copy(self.pid, write, la, ra, lens)  # typed error here if it cannot work; also warms up
        ffi, _ = ll._native()
        keep = (la, ra, lens)
        return (self.pid, 1 if write else 0, ffi.from_buffer("uint64_t[]", la), ffi.from_buffer("uint64_t[]", ra),
                ffi.from_buffer("uint64_t[]", lens), n, ll.MAX_CHUNK, ffi.NULL, ffi.new("uint64_t *"), keep)

    def throughput(self, nbytes: int, block: int, op: str, scattered: bool | None = None) -> float:
        """GiB/s of the best of ``repeat`` copies of ``nbytes`` in ``block`` runs (``op``: pull/push).

        ``scattered`` (default: blocks under 256 KiB) shuffles the blocks on both sides."""
        if nbytes > self.buf.nbytes or block <= 0 or nbytes % block:
            raise ValueError("nbytes must be a multiple of block and fit the buffer")
        sc = block < (256 << 10) if scattered is None else scattered
        *args, _keep = self._args(nbytes, block, op == "push", sc)
        copy = ll._native()[1].kvf_vm_copy
        best = float("inf")
        for _ in range(self.repeat):
            t0 = time.perf_counter()
            copy(*args)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / _GIB

    def latency(self, iters: int, block: int = 4096) -> list[float]:
        """Seconds of each of ``iters`` single-block reads (after 200 unrecorded ones)."""
        *args, _keep = self._args(block, block, False, False)
        copy = ll._native()[1].kvf_vm_copy
        clock = time.perf_counter
        out = []
        for i in range(iters + 200):
            t0 = clock()
            copy(*args)
            if i >= 200:
                out.append(clock() - t0)
        return out


def baseline(pid: int, buf: np.ndarray, repeat: int, remote_addr: int | None = None) -> RawBaseline:
    """``kvflow bench``'s raw baseline against the buffer at ``remote_addr`` in process ``pid``."""
    if remote_addr is None:
        raise ValueError("the shm raw baseline needs remote_addr: the peer's buffer address")
    return RawBaseline(pid, buf, repeat, remote_addr)


def _serve(conn: Connection, nbytes: int, block_size: int) -> None:
    """Peer process for :func:`shm_vs_raw`: an LlmDataDist (cluster 1) holding one cache."""
    import asyncio

    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole

    async def main() -> None:
        loop = asyncio.get_running_loop()
        opts = {"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": "shm"}
        async with LlmDataDist(1, LlmRole.PROMPT, options=opts) as dd:
            mem = np.ones(nbytes, dtype=np.uint8)
            cache = await dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, [nbytes // block_size, block_size]),
                                               [mem])
            assert dd.listen_address is not None
            conn.send((os.getpid(), dd.listen_address[1], cache.cache_id, int(mem.ctypes.data)))
            await loop.run_in_executor(None, conn.poll, 600)

    asyncio.run(main())


def shm_vs_raw(nbytes: int, block_size: int, *, iters: int = 30, seed: int = 0,
               options: dict[str, str] | None = None) -> dict[str, Any]:
    """p50 of a raw native copy and of ``LlmDataDist.pull_kv_blocks`` over shm, interleaved.

    Both move the same scattered blocks between the same two processes, alternately, so both
    see the same machine load; ``options`` go to the pulling side's ``initialize``. Returns ``{"nbytes", "block_size", "raw_p50_us", "shm_p50_us"}``."""
    import asyncio

    from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, nbytes, block_size), daemon=True)
    proc.start()
    child.close()

    async def client(pid: int, port: int, cache_id: int, remote_base: int) -> tuple[float, float]:
        async with LlmDataDist(2, options={**(options or {}), "kvflow.Transports": "shm"}) as dd:
            await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", port)])], 10_000)
            n = nbytes // block_size
            mem = np.zeros(nbytes, dtype=np.uint8)
            cache = await dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, [n, block_size]), [mem])
            rng = np.random.default_rng(seed)
            sb, db = rng.permutation(n), rng.permutation(n)
            ci = CacheIndex(1, cache_id)
            la = np.uint64(mem.ctypes.data) + db.astype(np.uint64) * np.uint64(block_size)
            ra = np.uint64(remote_base) + sb.astype(np.uint64) * np.uint64(block_size)
            lens = np.full(n, block_size, dtype=np.uint64)
            ffi, lib = ll._native()
            args = (pid, 0, ffi.from_buffer("uint64_t[]", la), ffi.from_buffer("uint64_t[]", ra),
                    ffi.from_buffer("uint64_t[]", lens), n, ll.MAX_CHUNK, ffi.NULL, ffi.new("uint64_t *"))
            sbl, dbl = sb.tolist(), db.tolist()
            raw, shm = np.empty(iters), np.empty(iters)
            clock = time.perf_counter
            for i in range(-max(3, iters // 20), iters):  # negative i: warm-up
                t0 = clock()
                lib.kvf_vm_copy(*args)
                t1 = clock()
                await dd.pull_kv_blocks(ci, cache, sbl, dbl)
                t2 = clock()
                if i >= 0:
                    raw[i], shm[i] = t1 - t0, t2 - t1
            return float(np.median(raw)), float(np.median(shm))

    try:
        if not parent.poll(60):
            raise TimeoutError("benchmark peer did not start")
        raw_p50, shm_p50 = asyncio.run(client(*parent.recv()))
    finally:
        stop_child(proc, parent)
    return {"nbytes": nbytes, "block_size": block_size, "raw_p50_us": raw_p50 * 1e6, "shm_p50_us": shm_p50 * 1e6}


CASES = [(4096, 4096, 5000), (64 << 20, 4 << 10, 20), (64 << 20, 16 << 10, 30), (64 << 20, 64 << 10, 30),
         (64 << 20, 256 << 10, 30), (64 << 20, 4 << 20, 30)]


def main(argv: list[str] | None = None) -> None:
    """Print the raw table, or with ``--vs-shm [key=value ...]`` raw and shm pulls side by side."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    options = dict(a.split("=", 1) for a in args if "=" in a)  # e.g. kvflow.shm.Threads=1
    if "--vs-shm" in args:
        print(f"{'bytes':>10} {'block':>8} {'raw p50 us':>11} {'shm p50 us':>11} {'shm/raw':>8}")
        for nbytes, bs, iters in CASES:
            r = shm_vs_raw(nbytes, bs, iters=iters, options=options)
            print(f"{nbytes:>10} {bs:>8} {r['raw_p50_us']:>11.1f} {r['shm_p50_us']:>11.1f} "
                  f"{r['raw_p50_us'] / r['shm_p50_us']:>8.2f}", flush=True)
        return
    print(f"{'bytes':>10} {'block':>8} {'runs':>6} {'p50 us':>10} {'p90 us':>10} {'GB/s':>7}")
    for nbytes, bs, iters in CASES:
        r = raw_readv(nbytes, bs, iters=iters)
        print(f"{r['nbytes']:>10} {r['block_size']:>8} {r['runs']:>6} {r['p50_us']:>10.1f} {r['p90_us']:>10.1f} "
              f"{r['gbps']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
