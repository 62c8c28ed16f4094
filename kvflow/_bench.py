"""``kvflow bench``: kvflow beside a raw baseline measured in the same run, between two processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ._datadist import LlmDataDist
from ._proc import PeerProcess, recv_from_parent
from ._ticker import FdTicker, Ticker, fd_ticker_available
from ._types import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmRole

GiB = 1 << 30
BLOCK_SIZES = (16 << 10, 256 << 10, 4 << 20)
LAT_BLOCK = 4 << 10
RAW_CHUNK = 1 << 20  # the raw baseline's send/recv size: the fastest plain-socket setting measured here
# op, nbytes, block: 1 = send me nbytes, 2 = take nbytes, 3 = 4 KiB ping, 4 / 5 = as 1 / 2 but the
# bytes are blocks of `block` bytes in a shuffled order on both sides (scatter-gather I/O),
# 6 = answer the next `nbytes` 4 KiB pings spinning on a non-blocking socket (the polled baseline)
_RAW = struct.Struct("<BQQ")
RAW_IOVS = 64  # views per sendmsg / recvmsg_into in the scattered baseline (1 MiB of 16 KiB blocks)


@dataclass
class Row:
    """One line of the table."""

    transport: str
    op: str
    block: str
    kvflow: float
    raw: float
    unit: str
    baseline: str = "raw socket"
    #: Throughput rows: GiB/s with a 1 ms sleeping ticker on both sides' loops, and each side's tick
    #: lateness (ms); then, from a second pass with a timerfd ticker (``FdTicker``), its lateness (ms).
    ticked: float | None = None
    late_worst_ms: float | None = None
    late_p99_ms: float | None = None
    peer_late_worst_ms: float | None = None
    peer_late_p99_ms: float | None = None
    fd_late_worst_ms: float | None = None
    fd_late_p99_ms: float | None = None
    peer_fd_late_worst_ms: float | None = None
    peer_fd_late_p99_ms: float | None = None

    @property
    def ratio(self) -> float:
        if self.unit == "GiB/s":
            return self.kvflow / self.raw if self.raw else 0.0
        return self.raw / self.kvflow if self.kvflow else 0.0


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _caches(total: int) -> list[tuple[str, CacheDesc]]:
    out = [(_fmt_size(b), CacheDesc(1, DataType.DT_UINT8, [total // b, b])) for b in BLOCK_SIZES]
    out.append(("lat", CacheDesc(1, DataType.DT_UINT8, [256, LAT_BLOCK])))
    return out


def _raw_server(lsock: socket.socket, buf: memoryview) -> None:
    """Plain blocking-socket peer for the raw baseline (a thread of the serving process)."""
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(_RAW.size)
    lat = buf[:LAT_BLOCK]
    with conn:
        while True:
            got = 0
            while got < len(hdr):
                n = conn.recv_into(memoryview(hdr)[got:])
                if not n:
                    return
                got += n
            op, nbytes, block = _RAW.unpack(hdr)
            if op == 1:
                for o in range(0, nbytes, RAW_CHUNK):
                    conn.sendall(buf[o : min(o + RAW_CHUNK, nbytes)])
            elif op == 2:
                _recv_all(conn, buf[:nbytes])
                conn.sendall(b"k")
            elif op == 3:
                conn.sendall(lat)
            elif op == 4:
                _scatter_io(conn.sendmsg, _shuffled(buf, nbytes, block, 1))
            elif op == 5:
                _scatter_io(lambda views: conn.recvmsg_into(views)[0], _shuffled(buf, nbytes, block, 1))
                conn.sendall(b"k")
            elif op == 6:
                conn.setblocking(False)
                try:
                    _answer_polled(conn, hdr, lat, nbytes)
                finally:
                    conn.setblocking(True)


def _answer_polled(conn: socket.socket, hdr: bytearray, reply: memoryview, count: int) -> None:
    """Answer ``count`` pings with ``reply``, spinning on the non-blocking ``conn`` (no sleep)."""
    view = memoryview(hdr)
    for _ in range(count):
        got = 0
        while got < len(hdr):
            try:
                n = conn.recv_into(view[got:])
            except BlockingIOError:
                continue
            if not n:
                raise ConnectionError("raw peer closed")
            got += n
        sent = 0
        while sent < len(reply):
            try:
                sent += conn.send(reply[sent:])
            except BlockingIOError:
                continue


def _shuffled(buf: memoryview, nbytes: int, block: int, seed: int) -> list[memoryview]:
    """Views of the ``nbytes // block`` blocks of ``buf`` in a random order."""
    order = np.random.default_rng(seed).permutation(nbytes // block).tolist()
    return [buf[b * block : (b + 1) * block] for b in order]


def _scatter_io(io: Any, views: list[memoryview]) -> None:
    """Move every view through ``io`` (sendmsg or recvmsg_into), RAW_IOVS views per call."""
    i = 0
    while i < len(views):
        n = io(views[i : i + RAW_IOVS])
        if n == 0:
            raise ConnectionError("raw peer closed")
        while n:
            size = len(views[i])
            if n >= size:
                n -= size
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


def _recv_all(conn: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = conn.recv_into(mv[got:], min(RAW_CHUNK, len(mv) - got))
        if not n:
            raise ConnectionError("raw peer closed")
        got += n


async def _serve(conn: Connection) -> None:
    args = conn.recv()
    total, transports = args["total"], args["transports"]
    buf = np.zeros(total, dtype=np.uint8)
    buf[:: 4096] = np.arange(buf[:: 4096].size, dtype=np.uint64).astype(np.uint8)
    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(lsock, buf.data), daemon=True).start()
    servers = {}
    for t in transports:
        dd = LlmDataDist(1, LlmRole.PROMPT)
        await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": t, **args.get("options", {})})
        ids = {name: (await dd.register_kv_cache(desc, [buf])).cache_id for name, desc in _caches(total)}
        servers[t] = dd
        conn.send({"transport": t, "address": dd.listen_address, "caches": ids})
    conn.send({"raw_port": lsock.getsockname()[1], "pid": os.getpid(), "addr": int(buf.ctypes.data)})
    ticker: Ticker | FdTicker = Ticker()
    while True:  # "tick" ("tick fd") starts this loop's ticker, "tock" stops it and answers its lateness
        msg = await recv_from_parent(conn)
        if msg in ("tick", "tick fd"):
            ticker = FdTicker() if msg == "tick fd" else Ticker()
            ticker.start()
        elif msg == "tock":
            conn.send(await ticker.stop())
        else:
            break
    for dd in servers.values():
        await dd.finalize()


def _best(samples: list[float]) -> float:
    return min(samples)


def _block_lists(desc: CacheDesc, scattered: bool) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination blocks of a throughput row: every block, shuffled when scattered."""
    n = desc.num_blocks
    rng = np.random.default_rng(0)
    if scattered:
        return rng.permutation(n), rng.permutation(n)
    return np.arange(n), np.arange(n)


async def _kv_throughput(dd: LlmDataDist, remote: CacheIndex, cache: Any, desc: CacheDesc, op: str,
                         blocks: tuple[np.ndarray, np.ndarray], repeat: int, warm: bool = True) -> float:
    """GiB/s of the best of ``repeat`` transfers of ``blocks`` (made beforehand: 65k-entry shuffles
    took 2-3 ms, which the ticker would count as kvflow's)."""
    src, dst = blocks
    times = []
    for _ in range(repeat + (1 if warm else 0)):  # a warm-up first (a new connection's window, first touches)
        t0 = time.perf_counter()
        if op == "pull":
            await dd.pull_kv_blocks(remote, cache, src, dst, timeout_in_millis=120_000)
        else:
            await dd.push_kv_blocks(cache, remote, src, dst, timeout_in_millis=120_000)
        times.append(time.perf_counter() - t0)
    return desc.tensor_bytes / _best(times[1:] if warm else times) / GiB


async def _ticked(peer: PeerProcess, run: Any, fd: bool = False) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``await run()`` with a 1 ms ticker on this loop and on the peer's (``fd``: an ``FdTicker``);
    its value and both summaries."""
    ticker: Ticker | FdTicker = FdTicker() if fd else Ticker()
    peer.send("tick fd" if fd else "tick")
    ticker.start()
    try:
        value = await run()
    finally:
        mine = await ticker.stop()
        peer.send("tock")
        theirs = await peer.recv(60)
    return value, mine, theirs


def _raw_throughput(sock: socket.socket, buf: memoryview, nbytes: int, op: str, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up, as for kvflow's rows
        t0 = time.perf_counter()
        if op == "pull":
            sock.sendall(_RAW.pack(1, nbytes, 0))
            _recv_all(sock, buf[:nbytes])
        else:
            sock.sendall(_RAW.pack(2, nbytes, 0))
            for o in range(0, nbytes, RAW_CHUNK):
                sock.sendall(buf[o : min(o + RAW_CHUNK, nbytes)])
            _recv_all(sock, memoryview(bytearray(1)))
        times.append(time.perf_counter() - t0)
    return nbytes / _best(times[1:]) / GiB


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q)) * 1e6


async def run_bench(transports: list[str], total: int = GiB, repeat: int = 3, lat_iters: int = 2000,
                    progress: Any = None, options: dict[str, str] | None = None) -> list[Row]:
    """Measure every transport against its raw baseline; returns the rows of the table.

    ``options`` go to both sides' ``initialize``, so an A/B of a transport option covers both loops.
    """
    options = dict(options or {})
    ours: dict[str, LlmDataDist] = {}
    try:  # this side first: a bad option is refused here, before the peer process starts
        for t in transports:
            ours[t] = LlmDataDist(2, LlmRole.DECODER)
            await ours[t].initialize({"kvflow.Transports": t, **options})
    except BaseException:
        for dd in ours.values():
            await dd.finalize()
        raise
    peer = PeerProcess(_serve)
    rows: list[Row] = []
    try:
        peer.send({"total": total, "transports": transports, "options": options})
        infos = [await peer.recv(60) for _ in transports]
        meta = await peer.recv(60)
        buf = np.zeros(total, dtype=np.uint8)
        raw = socket.create_connection(("127.0.0.1", meta["raw_port"]))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rawbuf = buf.data
        baselines = {"tcp": ("raw socket", _RawSocket(raw, rawbuf, repeat))}
        for info in infos:
            t = info["transport"]
            base_name, base = baselines.get(t) or _plugin_baseline(t, meta["pid"], meta["addr"], buf, repeat)
            dd = ours.pop(t)
            locals_ = {name: await dd.register_kv_cache(desc, [buf]) for name, desc in _caches(total)}
            ret = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo(*info["address"])])], 5000)
            if ret[0] != 0:
                raise RuntimeError(f"bench link over {t} failed: {ret[0].name}")
            for name, desc in _caches(total):
                if name == "lat":
                    continue
                for op in ("pull", "push"):
                    scattered = desc.stride == BLOCK_SIZES[0]
                    ci = CacheIndex(1, info["caches"][name])
                    blocks = _block_lists(desc, scattered)
                    kv = await _kv_throughput(dd, ci, locals_[name], desc, op, blocks, repeat)
                    # the same transfers with a 1 ms ticker on both loops: how late does kvflow make it?
                    kt, mine, theirs = await _ticked(peer, lambda: _kv_throughput(
                        dd, ci, locals_[name], desc, op, blocks, repeat, warm=False))  # noqa: B023 - awaited here
                    tick = {"ticked": kt, "late_worst_ms": mine["worst_ms"], "late_p99_ms": mine["p99_ms"],
                            "peer_late_worst_ms": theirs["worst_ms"], "peer_late_p99_ms": theirs["p99_ms"]}
                    if fd_ticker_available():  # again, with ticks that timer rounding does not delay
                        _, mine, theirs = await _ticked(peer, lambda: _kv_throughput(
                            dd, ci, locals_[name], desc, op, blocks, repeat, warm=False), fd=True)  # noqa: B023
                        tick.update({"fd_late_worst_ms": mine["worst_ms"], "fd_late_p99_ms": mine["p99_ms"],
                                     "peer_fd_late_worst_ms": theirs["worst_ms"],
                                     "peer_fd_late_p99_ms": theirs["p99_ms"]})
                    # off the loop: a long raw run must not starve this process's heartbeats
                    rb = await asyncio.to_thread(base.throughput, desc.tensor_bytes, desc.stride, op)
                    label = f"{name} scattered" if scattered else name
                    rows.append(Row(t, op, label, kv, rb, "GiB/s", base_name, **tick))
                    if scattered and isinstance(base, _RawSocket):  # what scattering costs the kernel
                        rs = await asyncio.to_thread(base.scattered, desc.tensor_bytes, desc.stride, op)
                        rows.append(Row(t, op, label, kv, rs, "GiB/s", "raw socket, scattered", **tick))
                    if progress:
                        progress(rows[-1])
            ci = CacheIndex(1, info["caches"]["lat"])
            cache = locals_["lat"]
            lat = []
            for i in range(lat_iters + 200):
                t0 = time.perf_counter()
                await dd.pull_kv_blocks(ci, cache, [i % 256], [(i * 7) % 256])
                if i >= 200:
                    lat.append(time.perf_counter() - t0)
            plat = []  # pushes: the same one-block exchange the other way
            for i in range(lat_iters + 200):
                t0 = time.perf_counter()
                await dd.push_kv_blocks(cache, ci, [(i * 7) % 256], [i % 256])
                if i >= 200:
                    plat.append(time.perf_counter() - t0)
            rlat = base.latency(lat_iters)  # on this thread: a worker thread adds GIL hand-offs to each reply
            for q, label in ((50, "p50"), (99, "p99")):
                rows.append(Row(t, f"4 KiB pull {label}", "4 KiB", _pct(lat, q), _pct(rlat, q), "us", base_name))
                if progress:
                    progress(rows[-1])
            for q, label in ((50, "p50"), (99, "p99")):  # the baseline moves the same bytes, as a read
                rows.append(Row(t, f"4 KiB push {label}", "4 KiB", _pct(plat, q), _pct(rlat, q), "us",
                                f"{base_name}, a read"))
                if progress:
                    progress(rows[-1])
            if t == "tcp":  # what any event-loop design pays here: the same exchange, awaited on this loop
                alat = await _awaited_latency(raw, rawbuf, lat_iters)
                rows.append(Row(t, "4 KiB pull p50", "4 KiB", _pct(lat, 50), _pct(alat, 50), "us",
                                "raw socket, awaited"))
                polled = baselines["tcp"][1].polled_latency(lat_iters)  # what polling reaches at best, no loop
                for q, label in ((50, "p50"), (99, "p99")):
                    rows.append(Row(t, f"4 KiB pull {label}", "4 KiB", _pct(lat, q), _pct(polled, q), "us",
                                    "raw socket, polled"))
            await dd.finalize()
        raw.close()
    finally:
        peer.stop()
        for dd in ours.values():
            await dd.finalize()
    return rows


class _RawSocket:
    """Raw baseline: the same bytes over a plain blocking socket between the same two processes."""

    def __init__(self, sock: socket.socket, buf: memoryview, repeat: int) -> None:
        self.sock, self.buf, self.repeat = sock, buf, repeat

    def throughput(self, nbytes: int, block: int, op: str) -> float:
        return _raw_throughput(self.sock, self.buf, nbytes, op, self.repeat)

    def scattered(self, nbytes: int, block: int, op: str) -> float:
        """GiB/s of the same bytes as blocks in shuffled order on both sides (sendmsg/recvmsg_into)."""
        times = []
        for _ in range(self.repeat + 1):  # the first is a warm-up
            views = _shuffled(self.buf, nbytes, block, 2)  # made before the clock starts, as kvflow plans
            t0 = time.perf_counter()
            if op == "pull":
                self.sock.sendall(_RAW.pack(4, nbytes, block))
                _scatter_io(lambda v: self.sock.recvmsg_into(v)[0], views)
            else:
                self.sock.sendall(_RAW.pack(5, nbytes, block))
                _scatter_io(self.sock.sendmsg, views)
                _recv_all(self.sock, memoryview(bytearray(1)))
            times.append(time.perf_counter() - t0)
        return nbytes / _best(times[1:]) / GiB

    def latency(self, iters: int) -> list[float]:
        out = []
        req = _RAW.pack(3, LAT_BLOCK, 0)
        mv = self.buf[:LAT_BLOCK]
        for i in range(iters + 200):
            t0 = time.perf_counter()
            self.sock.sendall(req)
            _recv_all(self.sock, mv)
            if i >= 200:
                out.append(time.perf_counter() - t0)
        return out

    def polled_latency(self, iters: int) -> list[float]:
        """The same exchange with both sides spinning on non-blocking sockets: the floor under any
        Python library that polls for a small reply (no sleep, no wake-up, no event loop)."""
        out = []
        sock = self.sock
        req = _RAW.pack(3, LAT_BLOCK, 0)
        mv = self.buf[:LAT_BLOCK]
        sock.sendall(_RAW.pack(6, iters + 200, 0))
        sock.setblocking(False)
        try:
            for i in range(iters + 200):
                t0 = time.perf_counter()
                sent = 0
                while sent < len(req):
                    try:
                        sent += sock.send(req[sent:])
                    except BlockingIOError:
                        continue
                got = 0
                while got < LAT_BLOCK:
                    try:
                        n = sock.recv_into(mv[got:])
                    except BlockingIOError:
                        continue
                    if not n:
                        raise ConnectionError("raw peer closed")
                    got += n
                if i >= 200:
                    out.append(time.perf_counter() - t0)
        finally:
            sock.setblocking(True)
        return out


async def _awaited_latency(sock: socket.socket, buf: memoryview, iters: int) -> list[float]:
    """The raw socket's 4 KiB exchange with the reply awaited through the event loop (no kvflow)."""
    loop = asyncio.get_running_loop()
    req = _RAW.pack(3, LAT_BLOCK, 0)
    mv = buf[:LAT_BLOCK]
    sock.setblocking(False)
    out = []
    try:
        for i in range(iters + 200):
            t0 = time.perf_counter()
            await loop.sock_sendall(sock, req)
            got = 0
            while got < LAT_BLOCK:
                got += await loop.sock_recv_into(sock, mv[got:])
            if i >= 200:
                out.append(time.perf_counter() - t0)
    finally:
        sock.setblocking(True)
    return out


def _plugin_baseline(name: str, pid: int, remote_addr: int, buf: np.ndarray, repeat: int) -> tuple[str, Any]:
    """A transport plugin's own raw baseline: ``<module>.bench.baseline(pid, buf, repeat, remote_addr=)``,
    an object with ``throughput(nbytes, block, op)`` (GiB/s) and ``latency(iters)`` (seconds per call)."""
    from ._discovery import load_bench

    mod = load_bench(name)
    return mod.BASELINE_NAME, mod.baseline(pid, buf, repeat, remote_addr=remote_addr)


def _pair(worst: float | None, p99: float | None) -> str:
    return "" if worst is None or p99 is None else f"{worst:.2f} / {p99:.2f}"


def format_rows(rows: list[Row]) -> list[list[str]]:
    """The table's cells: the row, then (throughput rows) GiB/s with the ticker and each side's
    worst / p99 tick lateness in ms, of the sleeping ticker and of the timerfd one."""
    out = []
    for r in rows:
        tick = ["", "", "", "", ""]
        if r.ticked is not None:
            tick = [f"{r.ticked:.2f}", _pair(r.late_worst_ms, r.late_p99_ms),
                    _pair(r.peer_late_worst_ms, r.peer_late_p99_ms), _pair(r.fd_late_worst_ms, r.fd_late_p99_ms),
                    _pair(r.peer_fd_late_worst_ms, r.peer_fd_late_p99_ms)]
        out.append([r.transport, r.op, r.block, f"{r.kvflow:.2f} {r.unit}", r.baseline,
                    f"{r.raw:.2f} {r.unit}", f"{r.ratio:.2f}", *tick])
    return out


async def idle_lateness(seconds: float = 1.0, fd: bool = False) -> dict[str, Any]:
    """The ticker's lateness on this loop with nothing else to do: the floor of the machine."""
    ticker: Ticker | FdTicker = FdTicker() if fd else Ticker()
    ticker.start()
    await asyncio.sleep(seconds)
    return await ticker.stop()


def write_json(path: str, rows: list[Row], meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, f, indent=2)


def main_bench(transports: list[str], total: int, repeat: int, options: dict[str, str] | None = None) -> list[Row]:
    from ._run import run

    return run(run_bench(transports, total, repeat, options=options))


if __name__ == "__main__":
    rows = main_bench(["tcp"], 256 << 20, 2)
    for r in format_rows(rows):
        print(" | ".join(r))
