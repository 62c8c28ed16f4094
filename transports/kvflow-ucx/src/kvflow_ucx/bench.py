"""Raw UCX baseline: ``ucp_get_nbx``/``ucp_put_nbx`` loops through the same native library, no asyncio.

``kvflow bench`` puts these rows beside the ucx transport's (``baseline(pid, buf, repeat)``), so
the transport's overhead is visible as a ratio. The baseline spawns its own peer process that
maps a buffer and progresses its worker whenever its event fd fires (as a kvflow peer does);
this process issues one batch of block-sized operations and spins on ``ucp_worker_progress``
until it completes. UCX settings come from the environment (``UCX_TLS`` ...) plus kvflow's
defaults, exactly as for the transport. ``python -m kvflow_ucx.bench`` prints kvflow-over-ucx
rows beside raw rows (:func:`compare`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from . import _lowlevel as ll
from ._transport import _ucx_config

__all__ = ["BASELINE_NAME", "RawUcx", "baseline", "compare", "raw_get"]

BASELINE_NAME = "raw ucx"
GiB = 1 << 30


def _serve(conn: Connection, nbytes: int, config: dict[str, str], busy: bool) -> None:
    """Peer process: map ``nbytes``, hand out address and rkey, progress until told to stop."""
    w = ll.Worker(config)
    buf = np.ones(nbytes, dtype=np.uint8)
    buf[::4096] = 7
    m = w.mem_map(int(buf.ctypes.data), nbytes)
    conn.send({"address": w.address, "rkey": m.rkey, "addr": int(buf.ctypes.data), "pid": os.getpid()})
    ep = w.connect(conn.recv())
    try:
        while True:
            w.progress()
            if busy:
                if conn.poll(0):
                    break
                continue
            if w.arm() == ll.UCS_OK:
                select.select([w.efd, conn.fileno()], [], [], 1.0)
            if conn.poll(0):
                break
    finally:
        del ep
        conn.close()


class RawUcx:
    """A connected raw UCX pair: this process's worker and a spawned peer's mapped buffer."""

    def __init__(self, buf: np.ndarray, repeat: int = 3, busy_peer: bool = False,
                 config: dict[str, str] | None = None) -> None:
        self.buf = buf
        self.repeat = repeat
        cfg = _ucx_config({})[0] if config is None else config
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, buf.nbytes, cfg, busy_peer), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.close()
            raise TimeoutError("raw UCX peer did not start")
        info: dict[str, Any] = self.conn.recv()
        self.w = ll.Worker(cfg)
        self.conn.send(self.w.address)
        self.ep = self.w.connect(info["address"])
        self.rkey = self.ep.rkey_unpack(info["rkey"])
        self.remote = int(info["addr"])
        self.map = self.w.mem_map(int(buf.ctypes.data), buf.nbytes)
        self.memh_tab = self.w.memh_table([self.map])
        self.rkey_tab = self.w.rkey_table([self.rkey])

    def _batch(self, put: bool, la: np.ndarray, ra: np.ndarray, lens: np.ndarray) -> None:
        idx = np.zeros(lens.size, dtype=np.int64)
        op = self.w.new_op()
        self.ep.rma(op, put, la, ra, lens, idx, self.memh_tab, idx, self.rkey_tab, 1 << 62)  # puts: + flush
        status = op.finish()
        while status is None:
            self.w.progress()
            for ev_id, _kind, st in self.w.events():
                if ev_id == op.id:
                    status = st
        if status != ll.UCS_OK:
            raise ll.ucx_error(status, "raw batch")

    def _runs(self, nbytes: int, block: int, scattered: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = nbytes // block
        rng = np.random.default_rng(0)
        lo = rng.permutation(n) if scattered else np.arange(n)
        ro = rng.permutation(n) if scattered else np.arange(n)
        b = np.uint64(block)
        la = np.uint64(self.buf.ctypes.data) + lo.astype(np.uint64) * b
        ra = np.uint64(self.remote) + ro.astype(np.uint64) * b
        return la, ra, np.full(n, block, dtype=np.uint64)

    def throughput(self, nbytes: int, block: int, op: str, scattered: bool | None = None) -> float:
        """GiB/s moving ``nbytes`` as ``block``-sized gets ("pull") or puts ("push"), best of ``repeat``."""
        if scattered is None:
            scattered = block <= 64 << 10
        la, ra, lens = self._runs(nbytes, block, scattered)
        put = op == "push"
        self._batch(put, la[:1], ra[:1], lens[:1])  # wire up
        times = []
        for _ in range(self.repeat):
            t0 = time.perf_counter()
            self._batch(put, la, ra, lens)
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / GiB

    def latency(self, iters: int, block: int = 4096) -> list[float]:
        """Seconds per single ``block``-byte get, ``iters`` samples after 200 warm-up ones."""
        out = []
        lens = np.full(1, block, dtype=np.uint64)
        for i in range(iters + 200):
            off = np.uint64((i % 256) * block)
            la = np.array([self.buf.ctypes.data], dtype=np.uint64) + off
            ra = np.array([self.remote], dtype=np.uint64) + np.uint64(((i * 7) % 256) * block)
            t0 = time.perf_counter()
            self._batch(False, la, ra, lens)
            if i >= 200:
                out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        try:
            self.conn.send("stop")
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


def baseline(pid: int, buf: np.ndarray, repeat: int, remote_addr: int | None = None) -> RawUcx:
    """``kvflow bench``'s hook: a raw UCX pair sized like ``buf``. ``pid`` and ``remote_addr`` (the
    bench peer's buffer) are unused: one-sided UCX needs a worker and a mapped buffer on the other
    side, so the baseline spawns its own peer process."""
    del pid, remote_addr
    return RawUcx(buf, repeat)


def raw_get(nbytes: int, block_size: int, *, repeat: int = 3, op: str = "pull",
            scattered: bool | None = None, busy_peer: bool = False) -> float:
    """GiB/s of one raw batch of ``nbytes / block_size`` gets (or puts) from a spawned peer."""
    if block_size <= 0 or nbytes < block_size or nbytes % block_size:
        raise ValueError("nbytes must be a positive multiple of block_size")
    buf = np.zeros(nbytes, dtype=np.uint8)
    raw = RawUcx(buf, repeat, busy_peer=busy_peer)
    try:
        return raw.throughput(nbytes, block_size, op, scattered)
    finally:
        raw.close()


async def _kvflow_peer(conn: Connection) -> None:
    """PeerProcess main for :func:`compare`: one touched buffer registered once per block size."""
    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole
    from kvflow._proc import recv_from_parent

    args = conn.recv()
    total = args["total"]
    buf = np.ones(total, dtype=np.uint8)
    async with LlmDataDist(1, LlmRole.PROMPT, options={"llm.ListenIpInfo": "127.0.0.1:0",
                                                       "kvflow.Transports": "ucx"}) as dd:
        ids = {}
        for block in args["blocks"]:
            desc = CacheDesc(1, DataType.DT_UINT8, [total // block, block])
            ids[block] = (await dd.register_kv_cache(desc, [buf])).cache_id
        assert dd.listen_address is not None
        conn.send({"port": dd.listen_address[1], "caches": ids})
        await recv_from_parent(conn)


async def compare(total: int = 256 << 20, repeat: int = 3, lat_iters: int = 2000,
                  blocks: tuple[int, ...] = (16 << 10, 256 << 10, 4 << 20)) -> list[dict[str, Any]]:
    """kvflow over ucx beside the raw baseline, measured in the same run (rows like ``kvflow bench``).

    16 KiB blocks are scattered (shuffled on both sides), larger ones contiguous. The raw baseline
    runs in a thread so that this process keeps answering the link's heartbeats."""
    import asyncio

    from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole
    from kvflow._proc import PeerProcess

    peer = PeerProcess(_kvflow_peer)
    rows: list[dict[str, Any]] = []
    raw: RawUcx | None = None
    try:
        peer.send({"total": total, "blocks": [*blocks, 4096]})
        info = await peer.recv(120)
        buf = np.ones(total, dtype=np.uint8)
        raw = RawUcx(buf, repeat)
        async with LlmDataDist(2, LlmRole.DECODER, options={"kvflow.Transports": "ucx"}) as dd:
            assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", info["port"])])],
                                              5000) == [0]
            for block in blocks:
                desc = CacheDesc(1, DataType.DT_UINT8, [total // block, block])
                cache = await dd.register_kv_cache(desc, [buf])
                ci = CacheIndex(1, info["caches"][block])
                n = total // block
                scattered = block <= 64 << 10
                rng = np.random.default_rng(0)
                src = rng.permutation(n) if scattered else np.arange(n)
                dst = rng.permutation(n) if scattered else np.arange(n)
                for op in ("pull", "push"):
                    times = []
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        if op == "pull":
                            await dd.pull_kv_blocks(ci, cache, src, dst, timeout_in_millis=600_000)
                        else:
                            await dd.push_kv_blocks(cache, ci, src, dst, timeout_in_millis=600_000)
                        times.append(time.perf_counter() - t0)
                    kv = total / min(times) / GiB
                    rb = await asyncio.to_thread(raw.throughput, total, block, op, scattered)
                    label = f"{block >> 10} KiB" + (" scattered" if scattered else "")
                    rows.append({"op": op, "block": label, "kvflow": kv, "raw": rb, "unit": "GiB/s",
                                 "ratio": kv / rb})
                await dd.unregister_kv_cache(cache.cache_id)
            desc = CacheDesc(1, DataType.DT_UINT8, [total // 4096, 4096])
            cache = await dd.register_kv_cache(desc, [buf])
            ci = CacheIndex(1, info["caches"][4096])
            lat = []
            for i in range(lat_iters + 200):
                t0 = time.perf_counter()
                await dd.pull_kv_blocks(ci, cache, [i % 256], [(i * 7) % 256])
                if i >= 200:
                    lat.append(time.perf_counter() - t0)
            rlat = await asyncio.to_thread(raw.latency, lat_iters)
            for q in (50, 99):
                k, r = float(np.percentile(lat, q)) * 1e6, float(np.percentile(rlat, q)) * 1e6
                rows.append({"op": f"4 KiB pull p{q}", "block": "4 KiB", "kvflow": k, "raw": r, "unit": "us",
                             "ratio": r / k})
    finally:
        if raw is not None:
            raw.close()
        peer.stop()
    return rows


def _main() -> None:  # pragma: no cover - manual table
    import argparse

    from kvflow._run import run

    ap = argparse.ArgumentParser(description="kvflow over ucx beside a raw UCX baseline")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tls = os.environ.get("UCX_TLS", "(UCX default)")
    print(f"UCX_TLS={tls}; {args.size_mib} MiB per transfer; best of {args.repeat}; ratio = kvflow / raw "
          "(throughput) or raw / kvflow (latency)")
    for r in run(compare(args.size_mib << 20, args.repeat)):
        print(f"ucx | {r['op']:<13} | {r['block']:<16} | kvflow {r['kvflow']:8.2f} {r['unit']:<5} | "
              f"raw ucx {r['raw']:8.2f} {r['unit']:<5} | ratio {r['ratio']:.2f}")


if __name__ == "__main__":  # pragma: no cover
    _main()
