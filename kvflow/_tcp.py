"""The built-in TCP transport: framed scatter-gather over one socket per link.

Both ends of a data socket may issue requests. Every frame starts with a 32-byte header
(kind, count, request id, argument, payload bytes); requests carry a run table of
(address, length) pairs. Payload bytes go straight between the socket and registered memory
with ``sendmsg`` / ``recvmsg_into`` on memoryviews: no copy through Python objects. A peer's
request is checked against the named cache's tensors before a byte is read or written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections import deque
from typing import Any, Callable, Mapping

import numpy as np

from ._memory import LocalCache, Registry
from ._status import LLMException, LLMLinkFailed, LLMParamInvalid, LLMStatusCode, error_for
from .transport import Endpoint, LinkChannel, RunBatch, Transport

log = logging.getLogger("kvflow.tcp")

HDR = struct.Struct("<BBHIQQQ")  # kind, flags, reserved, count, request id, arg, payload bytes
READ_REQ, READ_RSP, WRITE_REQ, WRITE_RSP = 1, 2, 3, 4
RUN = np.dtype([("addr", "<u8"), ("len", "<u8")])
MAX_RUNS = 1 << 14  # runs per frame
MAX_FRAME_BYTES = 1 << 30  # payload bytes per frame
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
RECV_BUDGET = 4 << 20  # bytes per readable callback before yielding to the loop
SEND_BUDGET = 4 << 20
_HDR_SIZE = HDR.size
_ST_HDR, _ST_RUNS, _ST_PAYLOAD, _ST_DISCARD = range(4)


def _run_table(addrs: np.ndarray, lens: np.ndarray) -> memoryview | bytes:
    """The wire form of a run list: (address, length) uint64 pairs, little-endian."""
    n = addrs.size
    if n <= 4:
        return struct.pack(f"<{2 * n}Q", *[v for pair in zip(addrs.tolist(), lens.tolist()) for v in pair])
    table = np.empty(n, dtype=RUN)
    table["addr"] = addrs
    table["len"] = lens
    return table.view(np.uint8).data


class _Transfer:
    """One read()/write() call: a future and the number of frames still outstanding."""

    __slots__ = ("fut", "left")

    def __init__(self, fut: asyncio.Future[None], frames: int) -> None:
        self.fut = fut
        self.left = frames

    def frame_done(self) -> None:
        self.left -= 1
        if self.left == 0 and not self.fut.done():
            self.fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)


class _Out:
    """One frame waiting to be sent."""

    __slots__ = ("bufs", "idx", "on_sent", "on_drop", "op")

    def __init__(self, bufs: list[Any], on_sent: Callable[[], None] | None = None,
                 on_drop: Callable[[], None] | None = None, op: _Op | None = None) -> None:
        self.bufs = bufs
        self.idx = -1  # -1: not started
        self.on_sent = on_sent
        self.on_drop = on_drop
        self.op = op


class _Op:
    """A request of ours waiting for its response."""

    __slots__ = ("kind", "req_id", "dests", "nbytes", "xfer", "abandoned", "out")

    def __init__(self, kind: int, req_id: int, dests: list[memoryview] | None, nbytes: int,
                 xfer: _Transfer) -> None:
        self.kind = kind
        self.req_id = req_id
        self.dests = dests
        self.nbytes = nbytes
        self.xfer = xfer
        self.abandoned = False
        self.out: _Out | None = None


class TcpChannel:
    """Both directions of one data socket: our requests, the peer's requests, responses."""

    def __init__(self, sock: socket.socket, registry: Registry,
                 on_broken: Callable[[BaseException], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._registry = registry
        self._on_broken = on_broken
        self._sendq: deque[_Out] = deque()
        self._writer_on = False
        self._pending: dict[int, _Op] = {}
        self._next_id = 1
        self._closed: BaseException | None = None
        # receive state
        self._state = _ST_HDR
        self._hdr = bytearray(_HDR_SIZE)
        self._hdr_mv = memoryview(self._hdr)
        self._got = 0
        self._cur: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._runs = bytearray()
        self._runs_mv = memoryview(self._runs)
        self._dests: list[memoryview] = []
        self._didx = 0
        self._left = 0
        self._on_payload: Callable[[], None] | None = None
        self._payload_op: _Op | None = None
        self._payload_pin: LocalCache | None = None
        self._scratch = memoryview(bytearray(1 << 20))
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop.add_reader(self._fd, self._on_readable)

    # ---------------------------------------------------------------- requests of ours
    def submit(self, kind: int, batch: RunBatch) -> tuple[_Transfer, list[_Op]]:
        """Queue the frames of one read (kind READ_REQ) or write (WRITE_REQ)."""
        if self._closed is not None:
            raise LLMLinkFailed(f"data connection is closed: {self._closed}")
        cache_id = batch.remote_cache.cache_id
        parts = batch.split(MAX_RUNS)
        xfer = _Transfer(self._loop.create_future(), len(parts))
        ops: list[_Op] = []
        local = batch.local_cache
        for part in parts:
            views = local.views(part.local_addrs, part.lengths, part.local_tensor)
            table = _run_table(part.remote_addrs, part.lengths)
            nbytes = part.nbytes
            req_id = self._next_id
            self._next_id += 1
            if kind == READ_REQ:
                op = _Op(READ_REQ, req_id, views, nbytes, xfer)
                bufs: list[Any] = [HDR.pack(READ_REQ, 0, 0, len(part), req_id, cache_id, nbytes), table]
            else:
                op = _Op(WRITE_REQ, req_id, None, nbytes, xfer)
                bufs = [HDR.pack(WRITE_REQ, 0, 0, len(part), req_id, cache_id, nbytes), table, *views]
            out = _Out(bufs, op=op)
            op.out = out
            self._pending[req_id] = op
            ops.append(op)
            self._sendq.append(out)
        self._flush()
        return xfer, ops

    def abandon(self, ops: list[_Op]) -> None:
        """The caller gave up: unsent frames are dropped, late payload is discarded."""
        for op in ops:
            op.abandoned = True
            out = op.out
            if out is not None and out.idx == -1 and out in self._sendq:
                self._sendq.remove(out)
                self._pending.pop(op.req_id, None)

    # ---------------------------------------------------------------- sending
    def _send(self, out: _Out) -> None:
        self._sendq.append(out)
        self._flush()

    def _flush(self) -> None:
        sock = self._sock
        budget = SEND_BUDGET
        q = self._sendq
        while q and budget > 0:
            out = q[0]
            if out.idx < 0:
                out.idx = 0
            bufs = out.bufs
            i = out.idx
            chunk = bufs[i : i + IOV_MAX]
            try:
                n = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail(LLMLinkFailed(f"data connection send failed: {exc}"))
                return
            budget -= n
            want = 0
            for b in chunk:
                want += len(b)
            full = n < want
            while n > 0:
                b = bufs[i]
                lb = len(b)
                if n >= lb:
                    n -= lb
                    i += 1
                else:
                    bufs[i] = memoryview(b)[n:]
                    n = 0
            out.idx = i
            if i == len(bufs):
                q.popleft()
                out.bufs = []
                if out.on_sent is not None:
                    out.on_sent()
            if full:
                break
        if q and not self._writer_on and self._closed is None:
            self._loop.add_writer(self._fd, self._flush)
            self._writer_on = True
        elif not q and self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False

    # ---------------------------------------------------------------- receiving
    def _on_readable(self) -> None:
        sock = self._sock
        budget = RECV_BUDGET
        try:
            while budget > 0:
                st = self._state
                if st == _ST_HDR:
                    n = sock.recv_into(self._hdr_mv[self._got :], _HDR_SIZE - self._got)
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    self._got += n
                    if self._got < _HDR_SIZE:
                        continue
                    self._got = 0
                    self._on_header()
                    if self._state == _ST_HDR:
                        return  # a whole frame: let the loop call again (level-triggered) if more waits
                elif st == _ST_RUNS:
                    n = sock.recv_into(self._runs_mv[self._got :])
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    self._got += n
                    if self._got == len(self._runs):
                        self._got = 0
                        self._on_runs()
                        if self._state == _ST_HDR:
                            return
                elif st == _ST_PAYLOAD:
                    op = self._payload_op
                    if op is not None and op.abandoned:
                        self._state = _ST_DISCARD
                        self._payload_op = None
                        continue
                    dests = self._dests
                    i = self._didx
                    n = sock.recvmsg_into(dests[i : i + IOV_MAX])[0]
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    budget -= n
                    self._left -= n
                    while n > 0:
                        lb = len(dests[i])
                        if n >= lb:
                            n -= lb
                            i += 1
                        else:
                            dests[i] = dests[i][n:]
                            n = 0
                    self._didx = i
                    if self._left == 0:
                        self._payload_done()
                        return
                else:  # discard
                    n = sock.recv_into(self._scratch, min(self._left, len(self._scratch)))
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    budget -= n
                    self._left -= n
                    if self._left == 0:
                        self._payload_done()
        except (BlockingIOError, InterruptedError):
            return
        except LLMException as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(LLMLinkFailed(f"data connection lost: {exc}"))

    def _expect_payload(self, dests: list[memoryview] | None, nbytes: int, done: Callable[[], None],
                        op: _Op | None = None, pin: LocalCache | None = None) -> None:
        self._left = nbytes
        self._on_payload = done
        self._payload_op = op
        self._payload_pin = pin
        if nbytes == 0:
            self._state = _ST_HDR
            done()
        elif dests is None:
            self._state = _ST_DISCARD
        else:
            self._dests = list(dests)
            self._didx = 0
            self._state = _ST_PAYLOAD

    def _payload_done(self) -> None:
        done = self._on_payload
        self._state = _ST_HDR
        self._on_payload = None
        self._payload_op = None
        self._payload_pin = None
        self._dests = []
        if done is not None:
            done()

    def _protocol_error(self, what: str) -> None:
        raise LLMLinkFailed(f"protocol error from peer: {what}")

    def _on_header(self) -> None:
        kind, _flags, _res, count, req_id, arg, total = HDR.unpack(self._hdr)
        self._cur = (kind, count, req_id, arg, total)
        if kind in (READ_REQ, WRITE_REQ):
            if not 0 < count <= MAX_RUNS or total > MAX_FRAME_BYTES:
                self._protocol_error(f"request with {count} runs / {total} bytes")
            self._runs = bytearray(count * RUN.itemsize)
            self._runs_mv = memoryview(self._runs)
            self._got = 0
            self._state = _ST_RUNS
        elif kind == READ_RSP:
            op = self._pending.pop(req_id, None)
            if op is None or op.kind != READ_REQ:
                self._protocol_error(f"response to unknown read {req_id}")
            assert op is not None
            if arg != 0:
                if total:
                    self._protocol_error("failed read carries payload")
                op.xfer.fail(error_for(arg, f"peer refused read: {LLMStatusCode.of(arg).name}"))
                return
            if total != op.nbytes:
                self._protocol_error(f"read {req_id}: {total} bytes, expected {op.nbytes}")
            dests = None if op.abandoned else op.dests
            self._expect_payload(dests, total, op.xfer.frame_done, op)
        elif kind == WRITE_RSP:
            op = self._pending.pop(req_id, None)
            if op is None or op.kind != WRITE_REQ:
                self._protocol_error(f"response to unknown write {req_id}")
            assert op is not None
            if arg != 0:
                op.xfer.fail(error_for(arg, f"peer refused write: {LLMStatusCode.of(arg).name}"))
            else:
                op.xfer.frame_done()
        else:
            self._protocol_error(f"unknown frame kind {kind}")

    def _check(self, cache_id: int, table: np.ndarray, total: int) -> tuple[LocalCache, list[memoryview]]:
        local = self._registry.get(cache_id)
        addrs = table["addr"]
        lens = table["len"]
        if int(lens.sum(dtype=np.uint64)) != total:
            raise LLMParamInvalid("run lengths do not add up to the payload size")
        return local, local.views(addrs, lens)

    def _on_runs(self) -> None:
        kind, count, req_id, cache_id, total = self._cur
        table = np.frombuffer(self._runs, dtype=RUN, count=count)
        self._state = _ST_HDR
        try:
            local, views = self._check(cache_id, table, total)
        except LLMException as exc:
            status = int(exc.status_code)
            log.debug("refusing peer request %d on cache %d: %s", req_id, cache_id, exc)
            if kind == READ_REQ:
                self._send(_Out([HDR.pack(READ_RSP, 0, 0, 0, req_id, status, 0)]))
            else:
                self._expect_payload(None, total, lambda: self._send(
                    _Out([HDR.pack(WRITE_RSP, 0, 0, 0, req_id, status, 0)])))
            return
        local.pin(self)

        def unpin() -> None:
            local.unpin(self)

        if kind == READ_REQ:
            self._send(_Out([HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, total), *views],
                            on_sent=unpin, on_drop=unpin))
        else:
            def done() -> None:
                unpin()
                self._send(_Out([HDR.pack(WRITE_RSP, 0, 0, 0, req_id, 0, 0)]))

            self._expect_payload(views, total, done, pin=local)

    # ---------------------------------------------------------------- teardown
    def _fail(self, exc: BaseException) -> None:
        if self._closed is not None:
            return
        self._closed = exc
        self._teardown(exc)
        self._on_broken(exc)

    def _teardown(self, exc: BaseException) -> None:
        try:
            self._loop.remove_reader(self._fd)
            if self._writer_on:
                self._loop.remove_writer(self._fd)
        except Exception:  # loop already closed
            pass
        self._writer_on = False
        if self._payload_pin is not None:  # a peer's write into our memory was cut short
            self._payload_pin.unpin(self)
            self._payload_pin = None
        for out in self._sendq:
            if out.on_drop is not None:
                out.on_drop()
        self._sendq.clear()
        pending, self._pending = self._pending, {}
        for op in pending.values():
            op.xfer.fail(exc)
        self._sock.close()

    def close(self, exc: BaseException | None = None) -> None:
        if self._closed is None:
            self._closed = exc or LLMLinkFailed("link closed")
            self._teardown(self._closed)


class TcpEndpoint(Endpoint):
    """The TCP data path of one link."""

    def __init__(self, channel: TcpChannel) -> None:
        self._ch = channel

    async def _run(self, kind: int, batch: RunBatch) -> None:
        xfer, ops = self._ch.submit(kind, batch)
        try:
            await xfer.fut
        except BaseException:
            self._ch.abandon(ops)
            raise

    async def read(self, batch: RunBatch) -> None:
        await self._run(READ_REQ, batch)

    async def write(self, batch: RunBatch) -> None:
        await self._run(WRITE_REQ, batch)

    def abort(self, exc: BaseException) -> None:
        self._ch.close(exc)

    async def close(self) -> None:
        self._ch.close()


class TcpTransport(Transport):
    """Framed scatter-gather over a TCP socket; works between any two hosts."""

    name = "tcp"

    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        sock = await channel.open_stream()
        return TcpEndpoint(TcpChannel(sock, self.ctx.registry, channel.broken))
