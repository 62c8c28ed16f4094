"""Raw UCX baseline: ``ucp_get_nbx``/``ucp_put_nbx`` loops through the same native library, no asyncio.

``kvflow bench`` puts these rows beside the ucx transport's (``baseline(pid, buf, repeat)``), so
the transport's overhead is visible as a ratio. The baseline spawns its own peer process that
maps a buffer and progresses its worker whenever its event fd fires (as a kvflow peer does);
this process issues one batch of block-sized operations and spins on ``ucp_worker_progress``
until it completes. UCX settings come from the environment (``UCX_TLS`` ...) plus kvflow's
defaults, exactly as for the transport. ``python -m kvflow_ucx.bench`` runs ``kvflow bench`` for
ucx alone (same rows, same code).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from kvflow.transport import stop_child

from . import _lowlevel as ll
from ._transport import _ucx_config

__all__ = ["BASELINE_NAME", "RawUcx", "baseline", "raw_get"]

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
        stop_child(self.proc, self.conn)


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


def _main() -> None:  # pragma: no cover - manual table
    """``python -m kvflow_ucx.bench [--size-mib N] [--repeat N]``: ``kvflow bench --transport ucx``."""
    import sys

    print(f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "kvflow", "bench", "--transport", "ucx", *sys.argv[1:]])


if __name__ == "__main__":  # pragma: no cover
    _main()
