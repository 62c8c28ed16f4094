"""The peer process of the reliability, fuzz and soak tests: an LlmDataDist driven over a Pipe.

Caches are allocated inside one buffer with guard bytes before, between and after the
tensors, so that a test can check that no byte outside the registered tensors changed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np

from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMException,
    LlmRole,
)
from kvflow import _tcp as tcp
from kvflow import _wire as wire
from kvflow._proc import PeerProcess, recv_from_parent
from kvflow.testing import inspect

GUARD = 4096
GUARD_BYTE = 0xA5


def pattern(seed: int, tensor: int, nbytes: int) -> np.ndarray:
    """Deterministic contents of one tensor."""
    return np.random.default_rng((seed, tensor)).integers(0, 256, size=nbytes, dtype=np.uint8)


class Guarded:
    """``num_tensors`` tensors inside one buffer, each surrounded by GUARD bytes of GUARD_BYTE."""

    def __init__(self, desc: CacheDesc, seed: int | None) -> None:
        self.desc = desc
        tb = desc.tensor_bytes
        self.buf = np.full(GUARD + desc.num_tensors * (tb + GUARD), GUARD_BYTE, dtype=np.uint8)
        self.tensors = [self.buf[GUARD + t * (tb + GUARD):GUARD + t * (tb + GUARD) + tb]
                        for t in range(desc.num_tensors)]
        self.fill(seed)

    def fill(self, seed: int | None) -> None:
        """Random bytes from ``seed``; a negative seed: tensor t is all ``(t * 7 + 1) % 256`` (cheap); None: 0."""
        for t, arr in enumerate(self.tensors):
            if seed is None:
                arr[:] = 0
            elif seed < 0:
                arr[:] = (t * 7 + 1) % 256
            else:
                arr[:] = pattern(seed, t, arr.size)

    def guards_ok(self) -> bool:
        tb = self.desc.tensor_bytes
        mask = np.ones(self.buf.size, dtype=bool)
        for t in range(self.desc.num_tensors):
            mask[GUARD + t * (tb + GUARD):GUARD + t * (tb + GUARD) + tb] = False
        return bool((self.buf[mask] == GUARD_BYTE).all())

    def crcs(self, blocks: list[int] | None = None) -> list[list[int]]:
        """crc32 of each [tensor][block] (all blocks when ``blocks`` is None)."""
        nb = self.desc.num_blocks
        stride = self.desc.stride
        idx = range(nb) if blocks is None else blocks
        return [[zlib.crc32(arr[b * stride:(b + 1) * stride]) for b in idx] for arr in self.tensors]


async def peer_main(conn: Connection) -> None:
    """Driven by (op, args) tuples; answers ("ok", value) or ("err", LLMException) or ("crash", text)."""
    cfg = conn.recv()
    dd = LlmDataDist(cfg["cluster"], LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": cfg.get("listen", "127.0.0.1:0"), **cfg.get("options", {})})
    caches: dict[int, Guarded] = {}
    handles: dict[int, Any] = {}
    for spec in cfg.get("caches", []):
        await _register(dd, caches, handles, *spec)
    conn.send({"address": dd.listen_address, "pid": os.getpid(), "caches": sorted(caches)})
    tasks: set[asyncio.Task[None]] = set()

    async def serve(req: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            conn.send((req, "ok", await _do(dd, caches, handles, op, *args)))
        except LLMException as exc:
            conn.send((req, "err", exc))
        except Exception:
            conn.send((req, "crash", traceback.format_exc()))

    while True:  # commands run concurrently; answers carry the command's number
        msg = await recv_from_parent(conn)
        if msg == "stop":
            break
        task = asyncio.ensure_future(serve(*msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()
    await dd.finalize()


async def _register(dd: LlmDataDist, caches: dict[int, Guarded], handles: dict[int, Any], num_tensors: int,
                    dtype: int, shape: list[int], seed: int | None) -> int:
    desc = CacheDesc(num_tensors, DataType(dtype), list(shape))
    g = Guarded(desc, seed)
    cache = await dd.register_kv_cache(desc, g.tensors)
    caches[cache.cache_id] = g
    handles[cache.cache_id] = cache
    return cache.cache_id


async def _do(dd: LlmDataDist, caches: dict[int, Guarded], handles: dict[int, Any], op: str, *args: Any) -> Any:
    if op == "register":
        return await _register(dd, caches, handles, *args)
    if op == "unregister":
        cache_id, timeout_ms = args
        await dd.unregister_kv_cache(cache_id, timeout_in_millis=timeout_ms)
        return None
    if op == "fill":
        cache_id, seed = args
        caches[cache_id].fill(seed)
        return None
    if op == "crcs":
        cache_id, blocks = args
        return caches[cache_id].crcs(blocks)
    if op == "addrs":
        return list(handles[args[0]].tensor_addrs)
    if op == "dump":
        return caches[args[0]].buf.tobytes()
    if op == "guards_ok":
        return caches[args[0]].guards_ok()
    if op == "inflight":  # peer operations holding the cache (pins)
        local = inspect.local_cache(dd, args[0])
        return None if local is None else local.inflight
    if op == "links":
        return {cid: link.state.value for cid, link in inspect.links(dd).items()}
    if op == "link":
        cluster, ip, port, timeout_ms = args
        return int((await dd.link_llm_clusters([ClusterInfo(cluster, [IpInfo(ip, port)])], timeout_ms))[0])
    if op == "pull_blocks":
        cluster, remote_id, local_id, src, dst, timeout_ms = args
        await dd.pull_kv_blocks(CacheIndex(cluster, remote_id), handles[local_id], src, dst,
                                timeout_in_millis=timeout_ms)
        return None
    if op == "push_blocks":
        cluster, remote_id, local_id, src, dst, timeout_ms = args
        await dd.push_kv_blocks(handles[local_id], CacheIndex(cluster, remote_id), src, dst,
                                timeout_in_millis=timeout_ms)
        return None
    raise ValueError(f"unknown op {op!r}")


async def many_main(conn: Connection) -> None:
    """``n`` LlmDataDist servers in one process (clusters first..first+n-1), one small cache each."""
    cfg = conn.recv()
    servers: list[tuple[LlmDataDist, Guarded]] = []
    out = []
    desc = CacheDesc(1, DataType.DT_UINT8, [4, 4096])
    for i in range(cfg["n"]):
        dd = LlmDataDist(cfg["first"] + i, LlmRole.PROMPT)
        await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", **cfg.get("options", {})})
        g = Guarded(desc, cfg["first"] + i)
        cache = await dd.register_kv_cache(desc, g.tensors)
        servers.append((dd, g))
        out.append((dd.listen_address, cache.cache_id))
    conn.send(out)
    while True:
        msg = await recv_from_parent(conn)
        if msg == "stop":
            break
        conn.send({dd.cluster_id: len(inspect.links(dd)) for dd, _ in servers})
    for dd, _ in servers:
        await dd.finalize()


class Peer:
    """The parent's handle on a peer process."""

    def __init__(self, cluster: int, caches: list[tuple[int, int, list[int], int | None]] | None = None,
                 options: dict[str, str] | None = None, listen: str = "127.0.0.1:0") -> None:
        self.proc = PeerProcess(peer_main)
        self.proc.send({"cluster": cluster, "caches": caches or [], "options": options or {}, "listen": listen})
        if not self.proc.conn.poll(60):
            self.proc.stop()
            raise RuntimeError("peer process did not start")
        hello = self.proc.conn.recv()
        self.cluster = cluster
        self.address: tuple[str, int] = tuple(hello["address"])
        self.pid: int = hello["pid"]
        self.caches: list[int] = hello["caches"]
        self._next = 0
        self._waiting: dict[int, asyncio.Future[tuple[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(self, op: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``op`` in the peer (several may run at once); its LLMException is raised here."""
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())
        self._next += 1
        req = self._next
        fut: asyncio.Future[tuple[str, Any]] = loop.create_future()
        self._waiting[req] = fut
        self.proc.send((req, op, args))
        try:
            kind, value = await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(req, None)
        if kind == "err":
            raise value
        if kind == "crash":
            raise AssertionError(f"peer crashed:\n{value}")
        return value

    async def _read(self) -> None:
        try:
            while True:
                req, kind, value = await self.proc.recv(3600)
                fut = self._waiting.get(req)
                if fut is not None and not fut.done():
                    fut.set_result((kind, value))
        except (EOFError, OSError, TimeoutError) as exc:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(EOFError(f"peer process is gone: {exc}"))

    def kill(self) -> None:
        """SIGKILL (reaped by ``stop``)."""
        os.kill(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.proc.stop()


class RawClient:
    """A hand-driven kvflow peer on blocking sockets, for sending what a real client never would."""

    def __init__(self, address: tuple[str, int], timeout: float = 5.0) -> None:
        self.address = address
        self.timeout = timeout
        self.sock = socket.create_connection(address, timeout=timeout)
        self.data: socket.socket | None = None

    def close(self) -> None:
        for s in (self.sock, self.data):
            if s is not None:
                s.close()

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def send_msg(self, msg: Any) -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        self.sock.sendall(struct.pack("<I", len(body)) + body)

    def recv_msg(self, answer_pings: bool = True) -> dict[str, Any] | None:
        """The next control frame (pings answered and skipped); None once the server closed."""
        while True:
            head = _recv_exact(self.sock, 4)
            if head is None:
                return None
            (n,) = struct.unpack("<I", head)
            body = _recv_exact(self.sock, n)
            if body is None:
                return None
            msg = msgpack.unpackb(body, raw=False)
            if answer_pings and isinstance(msg, dict) and msg.get("t") in ("ping", "pong"):
                if msg["t"] == "ping":
                    self.send_msg({"t": "pong"})
                continue
            return msg

    def closed_within(self, seconds: float) -> bool:
        """Whether the server closes the control connection within ``seconds`` (what it sends is skipped)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                if not self.sock.recv(65536):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def hello(self, cluster: int, expect: int, **extra: Any) -> dict[str, Any] | None:
        """Send the control magic and a hello (no key); the server's answer, a welcome unwrapped."""
        msg = {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": cluster, "expect": expect,
               "instance": os.urandom(8).hex(), "auth": False, "cnonce": os.urandom(32),
               "transports": ["tcp"], **extra}
        self.send(wire.MAGIC_CONTROL)
        self.send_msg(msg)
        return self.recv_sealed()

    def recv_sealed(self) -> dict[str, Any] | None:
        """The next frame; a sealed one (without a key) comes back as its inner map plus ``t``."""
        msg = self.recv_msg()
        if msg is not None and isinstance(msg.get("m"), bytes):
            return {**msgpack.unpackb(msg["m"], raw=False), "t": msg["t"]}
        return msg

    def send_sealed(self, t: str, inner: dict[str, Any]) -> None:
        self.send_msg({"t": t, "m": msgpack.packb(inner, use_bin_type=True)})

    def handshake(self, cluster: int, expect: int) -> dict[str, Any]:
        """A complete link as kvflow makes one (tcp, no key); returns the welcome."""
        welcome = self.hello(cluster, expect)
        assert welcome is not None and welcome["t"] == "welcome", welcome
        self.send_sealed("choose", {"transport": "tcp", "info": {}})
        accept = self.recv_sealed()
        assert accept is not None and accept["t"] == "accept", accept
        self.data = socket.create_connection(self.address, timeout=self.timeout)
        self.data.sendall(wire.MAGIC_DATA + welcome["token"])
        self.send_sealed("connected", {"ok": True})
        ready = self.recv_sealed()
        assert ready is not None and ready["t"] == "ready", ready
        return welcome

    # data frames (the TCP transport's framing)
    def data_frame(self, kind: int, req_id: int, cache_id: int, runs: list[tuple[int, int]], payload: bytes = b"",
                   total: int | None = None) -> bytes:
        table = b"".join(struct.pack("<QQ", a, n) for a, n in runs)
        total = sum(n for _, n in runs) if total is None else total
        return tcp.HDR.pack(kind, 0, 0, len(runs), req_id, cache_id, total) + table + payload

    def data_recv(self) -> tuple[tuple[int, ...], bytes] | None:
        """The next data frame: (header fields, payload); None once the server closed."""
        assert self.data is not None
        head = _recv_exact(self.data, tcp.HDR.size)
        if head is None:
            return None
        hdr = tcp.HDR.unpack(head)
        payload = _recv_exact(self.data, hdr[6]) if hdr[6] else b""
        if payload is None:
            return None
        return hdr, payload


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (TimeoutError, ConnectionError, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
