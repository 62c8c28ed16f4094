"""The built-in TCP transport: framed scatter-gather over one socket per link.

Both ends of a data socket may issue requests. Every frame starts with a 32-byte header
(kind, count, request id, argument, payload bytes); requests carry a run table of
(address, length) pairs. Payload bytes go straight between the socket and registered memory:
``sendmsg`` / ``recvmsg_into`` on memoryviews for a few runs, ``sendmsg`` / ``readv`` from an
iovec table for many (``kvflow._iov``); no copy through Python objects. A peer's request is
checked against the named cache's tensors before a byte is read or written (by the loop, or, for a
write that follows another on the same cache, by the worker's C loop with a strict subset of the
loop's checks: ``_serve_rx``). When a small frame
is due the channel busy-polls its socket for ``kvflow.tcp.BusyPollUs`` (see ``_expect_soon``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from bisect import bisect_left, bisect_right
from collections import deque
from concurrent.futures import Future
from functools import partial
from itertools import accumulate, islice
from typing import Any, Callable, Mapping, Union

import numpy as np

from . import _iov as iov
from . import _pump as pump
from ._iov import IovCursor
from ._memory import SMALL_RUNS, CacheUser, LocalCache, Registry
from ._plan import small_block_rows
from ._status import LLMException, LLMLinkFailed, LLMParamInvalid, LLMStatusCode, error_for
from .transport import Endpoint, LinkChannel, RemoteCache, RunBatch, Started, Transport, TransportContext

log = logging.getLogger("kvflow.tcp")

HDR = struct.Struct("<BBHIQQQ")  # kind, flags, reserved, count, request id, arg, payload bytes
READ_REQ, READ_RSP, WRITE_REQ, WRITE_RSP = 1, 2, 3, 4
RUN = np.dtype([("addr", "<u8"), ("len", "<u8")])
#: The header and run table of a request of ``n`` runs (``n`` up to SMALL_RUNS), by ``n``.
_SMALL_HEADS = tuple(struct.Struct(f"<BBHIQQQ{2 * n}Q") for n in range(SMALL_RUNS + 1))
_SMALL_RUNS_TABLES = tuple(struct.Struct(f"<{2 * n}Q") for n in range(SMALL_RUNS + 1))  # the run table alone
MAX_RUNS = 1 << 14  # runs per frame, at most (a peer's frame beyond either bound breaks the link)
MAX_FRAME_BYTES = 1 << 30  # payload bytes per frame, at most
FRAME_RUNS = 2048  # what our own frames carry at most: small enough to pipeline, big enough to amortise
FRAME_BYTES = 64 << 20
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: Payload bytes one sendmsg / recvmsg_into moves at most. A long syscall keeps its core from a
#: waking event loop until it returns (on loopback a send also runs the receiver's TCP path): two
#: ticking processes copying between them saw p99 lateness 0.58-0.83 ms with 1 MiB syscalls and
#: 0.31-0.43 ms with 64 KiB, at the same throughput (scripts/lateness_pair.py, docs/benchmarks.md).
CHUNK_BYTES = 64 << 10
RECV_BUDGET = 4 << 20  # bytes per readable callback before yielding to the loop
SEND_BUDGET = 4 << 20
SMALL_FRAME_BUFS = 16  # frames of at most this many buffers are offered to sendmsg whole at first
_ADDR_LIST = "tcp.addr_list"  # RemoteCache.cache key: the peer's tensor addresses as Python ints
POLL_BYTES = 64 << 10  # requests up to this size make the channel busy-poll for the next frame
DEFAULT_BUSY_POLL_US = 200
#: How long a small transfer reads for its reply inside the caller's own call (``TcpChannel.now``),
#: holding the loop meanwhile, before it waits on the loop (``kvflow.tcp.InlinePollUs``; at most
#: ``BusyPollUs``, the whole polling budget of a small request).
DEFAULT_INLINE_POLL_US = 100
#: Payload bytes left in a frame from which a worker thread moves the rest (``kvflow.tcp.ThreadBytes``)
DEFAULT_THREAD_BYTES = 1 << 20
DEFAULT_THREADS = 2  # worker threads per LlmDataDist (``kvflow.tcp.Threads``)
#: A payload of more runs than this goes to a worker thread whatever its size: the kernel spends
#: about 0.6 µs per iovec, so 16k runs of 16 bytes held the loop for milliseconds.
THREAD_RUNS = 256
SUBMIT_RUNS = FRAME_RUNS  # runs framed in one step of the loop
# Requests one side may have outstanding on a channel (sent, response not wholly received).
# The sender queues further frames locally (backpressure); a peer that exceeds the bound
# breaks the protocol and loses the link. This bounds the memory a peer can make us hold.
MAX_OUTSTANDING_FRAMES = 256
#: A receive job goes on through the responses to our next reads, up to about this many bytes, and
#: a send job through the responses queued behind the one it starts with, up to JOIN_BYTES: each
#: frame a job ends with wakes the loop, and each wake can make a sleeping timer of the caller's
#: late by up to 1 ms (docs/decisions.md, "tcp: one worker job across frames").
CHAIN_BYTES = 512 << 20
JOIN_BYTES = 1 << 30
JOIN_MIN_BYTES = 1 << 20
#: A receive job that lands a peer's write goes on through the writes after it (``_serve_rx``) up to
#: about this many bytes, then ends so that the pusher gets their answers while it still sends.
SERVE_BYTES = 128 << 20
MAX_OUTSTANDING_RUNS = 1 << 16
TX_ARENA_RUNS = 1 << 16  # a joined send of up to this many runs builds its table in kept memory
_SCRATCH = memoryview(bytearray(1 << 20))  # where discarded payload goes (shared: nobody reads it)
_HDR_SIZE = HDR.size
#: A header and one run: what the reader asks the socket for when the next frame can only be a
#: request of the peer's (nothing of ours is pending), so a one-run request takes one ``recv``.
_HDR_RUN = _HDR_SIZE + RUN.itemsize
_HDR_LEN = np.array([_HDR_SIZE], np.uint64)
_ST_HDR, _ST_RUNS, _ST_PAYLOAD, _ST_DISCARD = range(4)
_OP_BACKLOG, _OP_OUT, _OP_DONE = range(3)


def _wire(kind: int, req_id: int, cache_id: int, batch: RunBatch) -> tuple[Payload, bytes | np.ndarray, int]:
    """One request frame: its local side, its head (the header, then the remote runs as
    (address, length) uint64 pairs, little-endian, in one buffer) and its payload bytes."""
    n = len(batch)
    if n <= SMALL_RUNS:  # Python ints: cheaper than numpy for a few runs
        return _wire_small(kind, req_id, cache_id, batch.table.tolist(), batch.local_cache)
    nbytes = batch.nbytes
    buf = np.empty(_HDR_SIZE + n * RUN.itemsize, dtype=np.uint8)
    HDR.pack_into(buf.data, 0, kind, 0, 0, n, req_id, cache_id, nbytes)
    table = buf[_HDR_SIZE:].view(RUN)
    table["addr"] = batch.remote_addrs
    table["len"] = batch.lengths
    return _payload(batch), buf, nbytes


def _wire_small(kind: int, req_id: int, cache_id: int, rows: list[list[int]],
                local: LocalCache) -> tuple[list[memoryview], bytes, int]:
    """``_wire`` of a batch of at most SMALL_RUNS runs, its table given as lists of Python ints."""
    la, ra, ln, lt, _ = rows
    n, nbytes = len(ln), sum(ln)
    if n == 1:
        head = _SMALL_HEADS[1].pack(kind, 0, 0, 1, req_id, cache_id, nbytes, ra[0], nbytes)
    else:
        pairs = [0] * (2 * n)
        pairs[0::2] = ra
        pairs[1::2] = ln
        head = _SMALL_HEADS[n].pack(kind, 0, 0, n, req_id, cache_id, nbytes, *pairs)
    return local.views_small(la, ln, lt), head, nbytes


def _frames(batch: RunBatch) -> list[RunBatch]:
    """``batch`` cut into frames of at most FRAME_RUNS runs and FRAME_BYTES bytes (longer runs are
    cut): the peer starts on the first frame while we prepare the next."""
    n = len(batch)
    if n <= FRAME_RUNS and batch.nbytes <= FRAME_BYTES:
        return [batch]
    lengths = batch.lengths
    la, ra, lt, rt = batch.local_addrs, batch.remote_addrs, batch.local_tensor, batch.remote_tensor
    if int(lengths.max()) > FRAME_BYTES:
        lengths = lengths.astype(np.uint64)
        pieces = (lengths + np.uint64(FRAME_BYTES - 1)) // np.uint64(FRAME_BYTES)
        src = np.repeat(np.arange(n), pieces.astype(np.int64))
        first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
        off = (np.arange(src.size, dtype=np.uint64) - first.astype(np.uint64)) * np.uint64(FRAME_BYTES)
        lengths = np.minimum(lengths[src] - off, np.uint64(FRAME_BYTES))
        la, ra, lt, rt = la[src] + off, ra[src] + off, lt[src], rt[src]
        n = int(src.size)
    cum = np.cumsum(lengths, dtype=np.uint64)
    out: list[RunBatch] = []
    start, base = 0, 0
    while start < n:
        end = min(n, start + FRAME_RUNS, int(np.searchsorted(cum, base + FRAME_BYTES, side="right")))
        end = max(end, start + 1)
        out.append(RunBatch(la[start:end], ra[start:end], lengths[start:end], lt[start:end], rt[start:end],
                            batch.local_cache, batch.remote_cache))
        base = int(cum[end - 1])
        start = end
    return out


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


class _Cursor:
    """A position in a list of buffers; advancing costs a bisect, not a Python step per buffer."""

    __slots__ = ("bufs", "ends", "i", "pos")

    def __init__(self, bufs: list[Any]) -> None:
        self.bufs = bufs
        self.ends = list(accumulate(map(len, bufs)))  # memoryviews here are byte-formatted
        self.i = 0  # first buffer not wholly consumed
        self.pos = 0  # bytes consumed

    @property
    def done(self) -> bool:
        return self.i >= len(self.bufs)

    @property
    def left(self) -> int:
        """Bytes not yet consumed."""
        return (self.ends[-1] if self.ends else 0) - self.pos

    @property
    def runs_left(self) -> int:
        """Buffers not wholly consumed."""
        return len(self.bufs) - self.i

    def chunk(self) -> tuple[list[Any], int]:
        """The buffers for the next syscall, and their total size: at most ``CHUNK_BYTES``, the
        last buffer cut short if it reaches further."""
        i, bufs, ends, pos = self.i, self.bufs, self.ends, self.pos
        off = pos - (ends[i - 1] if i else 0)
        j = min(bisect_left(ends, pos + CHUNK_BYTES, i) + 1, i + IOV_MAX, len(bufs))
        head = bufs[i] if off == 0 else memoryview(bufs[i])[off:]
        parts = [head, *bufs[i + 1 : j]]
        size = ends[j - 1] - pos
        over = size - CHUNK_BYTES
        if over > 0:
            last = parts[-1]
            parts[-1] = memoryview(last)[: len(last) - over]
            size = CHUNK_BYTES
        return parts, size

    def advance(self, n: int) -> None:
        self.pos += n
        self.i = bisect_right(self.ends, self.pos, self.i)

    def send(self, sock: socket.socket) -> tuple[int, int]:
        """One ``sendmsg`` of the next chunk: (bytes sent, bytes offered)."""
        chunk, want = self.chunk()
        return sock.sendmsg(chunk), want

    def recv(self, sock: socket.socket) -> int:
        return sock.recvmsg_into(self.chunk()[0])[0]

    def as_iov(self) -> IovCursor:
        """The bytes left as a table of (address, length), for kvflow._pump's C loop. It keeps the
        buffers alive and advances apart from this cursor (the job advances both)."""
        i = self.i
        heads = [np.frombuffer(b, np.uint8) for b in self.bufs[i:]]
        addrs = np.array([h.__array_interface__["data"][0] for h in heads], np.uint64)
        lens = np.array([h.size for h in heads], np.uint64)
        off = self.pos - (self.ends[i - 1] if i else 0)
        if heads and off:
            addrs[0] += np.uint64(off)
            lens[0] -= np.uint64(off)
        return IovCursor(addrs, lens, CHUNK_BYTES, keep=heads)


#: A frame's payload in local memory: byte views of its runs (few runs), or the checked runs
#: themselves as (addresses, lengths) for large payloads (see kvflow._iov).
Payload = Union[list[memoryview], tuple[np.ndarray, np.ndarray]]


def _cursor(payload: Payload) -> _Cursor | IovCursor:
    if isinstance(payload, tuple):
        return IovCursor(payload[0], payload[1], CHUNK_BYTES)
    return _Cursor(payload)


def _frame_cursor(bufs: list[Any], runs: tuple[np.ndarray, np.ndarray]) -> IovCursor:
    """One cursor over a whole frame: its header buffers, then its payload straight from the run
    table. The frame goes out in as few syscalls as its size allows, from the loop or from a worker
    thread, with no Python step between header and payload."""
    heads = [b if isinstance(b, np.ndarray) else np.frombuffer(b, np.uint8) for b in bufs]
    addrs = np.concatenate((np.array([h.__array_interface__["data"][0] for h in heads], np.uint64), runs[0]))
    lens = np.concatenate((np.array([h.size for h in heads], np.uint64), runs[1]))
    return IovCursor(addrs, lens, CHUNK_BYTES, keep=heads)


def _payload(batch: RunBatch) -> Payload:
    """The local side of a frame of ours: runs planned inside our registered tensors."""
    local = batch.local_cache
    if len(batch) > SMALL_RUNS and iov.AVAILABLE:
        local.check_host()
        return batch.local_addrs, batch.lengths
    return local.views(batch.local_addrs, batch.lengths, batch.local_tensor)


_NO_CURSOR = _Cursor([])


class _Out:
    """One frame waiting to be sent.

    ``pinned`` is the local cache whose memory the frame's payload reads (unpinned once the
    frame is wholly handed to the kernel or dropped); ``on_done`` runs once, sent or dropped;
    ``rsp_req`` is the peer's request id for a response to the peer's read. ``bufs`` go first,
    then ``runs`` (a large payload sent straight from its run table)."""

    __slots__ = ("bufs", "cursor", "idx", "on_done", "op", "pinned", "rsp_req", "runs")

    def __init__(self, bufs: list[Any], payload: Payload | None = None, on_done: Callable[[], None] | None = None,
                 op: _Op | None = None, pinned: LocalCache | None = None, rsp_req: int | None = None) -> None:
        self.runs: tuple[np.ndarray, np.ndarray] | None = None
        if isinstance(payload, tuple):
            self.runs = payload
        elif payload:
            bufs = [*bufs, *payload]
        self.bufs = bufs
        self.cursor: _Cursor | IovCursor | None = None
        self.idx = -1  # -1: not started
        self.on_done = on_done
        self.op = op
        self.pinned = pinned
        self.rsp_req = rsp_req


class _Op:
    """A request of ours waiting for its response."""

    __slots__ = ("abandoned", "dests", "kind", "nbytes", "out", "req_id", "runs", "state", "xfer")

    def __init__(self, kind: int, req_id: int, dests: Payload | None, nbytes: int, runs: int,
                 xfer: _Transfer) -> None:
        self.kind = kind
        self.req_id = req_id
        self.dests = dests
        self.nbytes = nbytes
        self.runs = runs
        self.xfer = xfer
        self.abandoned = False
        self.out: _Out | None = None
        self.state = _OP_BACKLOG  # -> _OP_OUT (admitted, counted) -> _OP_DONE (retired or dropped)


def _bulk(out: _Out) -> bool:
    """Whether ``out`` sends from a pinned cache: a response to a peer's read, or a write of ours
    whose caller still waits."""
    if out.pinned is None:
        return False
    if out.rsp_req is not None:
        return True
    op = out.op
    return op is not None and op.kind == WRITE_REQ and not op.abandoned


def _joinable(out: _Out) -> bool:
    """Whether ``out`` is a large ``_bulk`` frame (from a run table, or at least JOIN_MIN_BYTES): a
    send job may take several end to end. Anything else queued behind such a job cuts it short
    (``_cut_tx``), so that it waits for one frame at most, as without joining."""
    return _bulk(out) and (out.runs is not None or sum(map(len, out.bufs)) >= JOIN_MIN_BYTES)


def _beside(job: pump.Job | None, step: Callable[[], None]) -> None:
    """Run ``step``, the loop thread's own reads or sends on a socket that ``job``'s worker thread
    uses in the other direction, with the job's C loop making no syscall meanwhile
    (``kvflow._pump.Job.nudge``)."""
    if job is None or not job.native:
        step()
        return
    job.nudge()
    try:
        step()
    finally:
        job.unnudge()


class TcpChannel(CacheUser):
    """Both directions of one data socket: our requests, the peer's requests, responses."""

    def __init__(self, sock: socket.socket, registry: Registry,
                 on_broken: Callable[[BaseException], None], busy_poll: float = 0.0,
                 workers: Callable[[], pump.Pool] | None = None,
                 thread_bytes: int = DEFAULT_THREAD_BYTES, inline_poll: float = 0.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._inline_poll = inline_poll  # seconds ``now`` reads for a small reply itself
        self._workers = workers  # large payloads go to these threads (kvflow._pump); None: all on the loop
        self._thread_bytes = thread_bytes
        self._rx_job: pump.Job | None = None  # the payload a worker thread is reading, if any
        self._tx_job: pump.Job | None = None  # the head frame's payload a worker thread is sending
        self._tx_arena = np.empty(0, np.uint64)  # a joined send's table lives here (``_tx_table_arena``)
        # A send job that goes on through the responses queued behind the head (_join_tx): those
        # frames, where each ends in the job's bytes, how many are retired, whether it was cut short.
        self._tx_outs: list[_Out] = []
        self._tx_ends: list[int] = []
        self._tx_done = 0
        self._tx_cut = False
        # A receive job that goes on through the responses to our next reads (_chain_rx): those
        # reads, the job's bytes in all, and the slots their headers land in.
        self._rx_chain: list[_Op] = []
        self._rx_bytes = 0
        self._rx_slots = np.zeros((0, _HDR_SIZE), np.uint8)
        self._busy_poll = busy_poll  # seconds of polling when a small frame is due (see _expect_soon)
        self._poll_until = 0.0
        self._last_request = 0.0  # when the peer's last small request arrived (_next_request_soon)
        self._polling = False
        self._sock = sock
        self._fd = sock.fileno()
        self._registry = registry
        self._on_broken = on_broken
        self._sendq: deque[_Out] = deque()
        self._writer_on = False
        self._pending: dict[int, _Op] = {}  # admitted requests of ours awaiting their response header
        self._backlog: deque[_Op] = deque()  # requests of ours waiting for room (bounded outstanding)
        self._backlog_dead = 0  # abandoned ops still in _backlog
        self._out_frames = 0  # our admitted requests whose response is not wholly received
        self._out_runs = 0
        self._serving_frames = 0  # the peer's requests whose response is not wholly sent
        self._serving_runs = 0
        self._next_id = 1
        self._closed: BaseException | None = None
        # receive state
        self._state = _ST_HDR
        self._hdr = bytearray(_HDR_RUN)  # a header, and the first run of a request read with it
        self._hdr_mv = memoryview(self._hdr)
        self._got = 0
        self._cur: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._runs_small = memoryview(bytearray(SMALL_RUNS * RUN.itemsize))
        self._runs_mv = self._runs_small[:0]  # the run table being received
        self._rx: _Cursor | IovCursor = _NO_CURSOR
        self._left = 0
        self._on_payload: Callable[[], None] | None = None
        self._payload_op: _Op | None = None
        self._payload_pin: LocalCache | None = None
        self._payload_req = 0  # the peer's request id while its write payload lands in _payload_pin
        self._payload_served: Callable[[], None] | None = None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop.add_reader(self._fd, self._on_readable)

    @property
    def idle(self) -> bool:
        """``now`` may take a request: it has a poll window, nothing of ours or the peer's is in
        flight, and the reader waits for a frame's first byte."""
        return self._inline_poll > 0.0 and not (
            self._pending or self._sendq or self._backlog or self._closed is not None or self._state != _ST_HDR
            or self._got or self._rx_job is not None)

    # ---------------------------------------------------------------- requests of ours
    def submit(self, kind: int, batch: RunBatch) -> tuple[_Transfer, list[_Op]]:
        """Queue the frames of one read (kind READ_REQ) or write (WRITE_REQ)."""
        if self._closed is not None:
            raise LLMLinkFailed(f"data connection is closed: {self._closed}")
        cache_id = batch.remote_cache.cache_id
        parts = _frames(batch)
        xfer = _Transfer(self._loop.create_future(), len(parts))
        ops: list[_Op] = []
        local = batch.local_cache
        nbytes = 0
        for part in parts:
            req_id = self._next_id
            self._next_id += 1
            payload, head, nbytes = _wire(kind, req_id, cache_id, part)
            ops.append(self._queue(kind, req_id, payload, head, nbytes, len(part), xfer, local))
        self._admit()
        if len(parts) == 1 and nbytes <= POLL_BYTES:
            self._expect_soon()
        return xfer, ops

    def _queue(self, kind: int, req_id: int, payload: Payload, head: bytes | np.ndarray, nbytes: int, runs: int,
               xfer: _Transfer, local: LocalCache) -> _Op:
        """One request frame of ours into the backlog (``_admit`` sends it when the bounds allow)."""
        if kind == READ_REQ:
            op = _Op(READ_REQ, req_id, payload, nbytes, runs, xfer)
            out = _Out([head], op=op)
        else:
            op = _Op(WRITE_REQ, req_id, None, nbytes, runs, xfer)
            # the frame reads local memory until it is wholly sent, even if the caller gives up
            # meanwhile: the cache stays pinned (unregister waits for it) until then
            out = _Out([head], payload, op=op, pinned=local)
            local.pin(self)
        op.out = out
        self._backlog.append(op)
        return op

    def now(self, kind: int, batch: RunBatch) -> tuple[int, int] | Started | None:
        """A small request answered on the spot: sent, then its reply read from this very call for up
        to ``inline_poll`` seconds, with no future to wake and no loop turn (the peer's requests that
        come in meanwhile are served as the reader would). Returns (bytes, runs) once it is done
        (raises its typed error if it failed); ``Started`` when the reply is late (the loop then
        polls on for ``busy_poll``, as for any small request); None, with nothing sent, unless the
        channel is idle and the batch is at most SMALL_RUNS runs and POLL_BYTES bytes."""
        if len(batch) > SMALL_RUNS or not self.idle:
            return None
        return self.now_rows(kind, batch.table.tolist(), batch.local_cache, batch.remote_cache.cache_id)

    def now_rows(self, kind: int, rows: list[list[int]], local: LocalCache,
                 cache_id: int) -> tuple[int, int] | Started | None:
        """``now`` of a batch given as its table's five rows of Python ints (``RunBatch.ROWS``), the
        peer's cache by id: tiny plans skip numpy. The caller has checked that the channel is idle.

        The usual exchange makes no request object: one ``sendmsg`` takes the whole frame, the
        reply's header is read straight into the reader's header buffer, and a reply that is ours,
        successful and of the expected size has its payload read into the destination at once.
        Anything else (a short send, a late or failed reply, a partial payload, the peer's own
        request first) registers the request as the queue would have, hands what was read to
        the reader's state machine, and goes on as the ordinary path."""
        n = len(rows[2])
        if n > SMALL_RUNS or sum(rows[2]) > POLL_BYTES:
            return None
        req_id = self._next_id
        self._next_id += 1
        payload, head, nbytes = _wire_small(kind, req_id, cache_id, rows, local)
        read = kind == READ_REQ
        sock, clock = self._sock, time.perf_counter
        until = clock() + self._inline_poll
        try:
            sent = sock.sendmsg([head] if read else [head, *payload])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            lost = LLMLinkFailed(f"data connection send failed: {exc}")
            self._fail(lost)
            raise lost from exc
        whole = sent == len(head) + (0 if read else nbytes)
        got = 0  # bytes of the next frame's header read here
        if whole:
            try:
                while True:
                    try:
                        got = sock.recv_into(self._hdr_mv, _HDR_SIZE)
                    except (BlockingIOError, InterruptedError):
                        if clock() > until:
                            break  # late: the loop below waits for it
                        continue
                    if got == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    break
                if got == _HDR_SIZE:
                    rsp, _flags, _res, _count, rid, arg, total = HDR.unpack_from(self._hdr)
                    if rid == req_id and arg == 0 and rsp == (READ_RSP if read else WRITE_RSP) \
                            and total == (nbytes if read else 0):
                        if not read:
                            return nbytes, n
                        rest = self._payload_now(payload)
                        if rest == total:
                            return nbytes, n
                        xfer, op = self._begun(kind, req_id, payload, head, nbytes, n, local, sent)
                        del self._pending[req_id]  # as the reader does once it has a response's header
                        self._read_rest(op, payload, total, rest)
                        got = -1
            except OSError as exc:
                xfer, op = self._begun(kind, req_id, payload, head, nbytes, n, local, sent)
                if got == _HDR_SIZE:  # inside our reply's payload: the teardown fails the request from here
                    del self._pending[req_id]
                    self._payload_op = op
                self._fail(LLMLinkFailed(f"data connection lost: {exc}"))
                got = -1
        if got >= 0:
            xfer, op = self._begun(kind, req_id, payload, head, nbytes, n, local, sent)
            if got == _HDR_SIZE:  # not the reply we hoped for: the reader takes the frame from its header
                try:
                    self._on_header()
                except LLMException as exc:
                    self._fail(exc)
                except OSError as exc:
                    self._fail(LLMLinkFailed(f"data connection lost: {exc}"))
            else:
                self._got = got
        fut, read_more = xfer.fut, self._on_readable
        while not fut.done():
            if clock() > until:
                self._expect_soon()
                return Started(self.wait(xfer, [op]), nbytes, n)
            read_more()
        fut.result()  # its typed error, if the peer refused it or the link broke
        return nbytes, n

    def _payload_now(self, dests: list[memoryview]) -> int:
        """Bytes of a small reply's payload that one ``recvmsg_into`` put in ``dests`` (0 when none
        had come yet); OSError once the peer closed."""
        try:
            got = self._sock.recvmsg_into(dests)[0]
        except (BlockingIOError, InterruptedError):
            return 0
        if got == 0:
            raise ConnectionResetError("peer closed the data connection")
        return got

    def _begun(self, kind: int, req_id: int, payload: list[memoryview], head: bytes, nbytes: int, runs: int,
               local: LocalCache, sent: int) -> tuple[_Transfer, _Op]:
        """Register a request ``now_rows`` began, ``sent`` bytes of its frame already with the
        kernel, as ``_queue`` and ``_admit`` would have: admitted and pending, the rest queued."""
        xfer = _Transfer(self._loop.create_future(), 1)
        op = self._queue(kind, req_id, payload, head, nbytes, runs, xfer, local)
        if not sent:
            self._admit()
            return xfer, op
        assert self._backlog[-1] is op
        self._backlog.pop()
        op.state = _OP_OUT
        self._out_frames += 1
        self._out_runs += runs
        self._pending[req_id] = op
        out = op.out
        assert out is not None
        if sent == sum(map(len, out.bufs)):
            self._dropped(out)  # wholly sent: a write's pin goes (nothing of it is queued)
        else:
            self._send_rest(out, sent)
        return xfer, op

    def _send_rest(self, out: _Out, sent: int) -> None:
        """Queue ``out``, whose first ``sent`` bytes a direct ``sendmsg`` already gave the kernel: the
        rest goes out from the queue, and a frame begun on the wire can no longer be dropped or
        replaced (``abandon``, ``revoke``)."""
        if sent:
            out.cursor = cur = _Cursor(out.bufs)
            cur.advance(sent)
            out.idx = 0
        self._send(out)

    async def wait(self, xfer: _Transfer, ops: list[_Op]) -> None:
        """Wait for ``xfer``; a caller that gives up abandons ``ops`` (no late byte lands)."""
        try:
            await xfer.fut
        except BaseException:
            self.abandon(ops)
            raise

    def _admit(self) -> None:
        """Move requests from the backlog to the send queue while the outstanding bounds allow."""
        moved = False
        self._compact()
        q = self._backlog
        while q:
            op = q[0]
            if op.state == _OP_DONE:  # abandoned while waiting
                q.popleft()
                self._backlog_dead -= 1
                continue
            if self._out_frames and (self._out_frames >= MAX_OUTSTANDING_FRAMES
                                     or self._out_runs + op.runs > MAX_OUTSTANDING_RUNS):
                break
            q.popleft()
            op.state = _OP_OUT
            self._out_frames += 1
            self._out_runs += op.runs
            self._pending[op.req_id] = op
            assert op.out is not None
            self._sendq.append(op.out)
            moved = True
        if moved:
            self._flush()

    def _compact(self) -> None:
        """Drop given-up requests from the backlog once they are many (keeps it O(live requests))."""
        dead = self._backlog_dead
        if dead and (dead == len(self._backlog) or (dead > 16 and 2 * dead > len(self._backlog))):
            self._backlog = deque(op for op in self._backlog if op.state != _OP_DONE)
            self._backlog_dead = 0

    def _retire(self, op: _Op) -> None:
        """Our request ``op`` is finished with (its response wholly received, or never sent)."""
        if op.state == _OP_OUT:
            self._out_frames -= 1
            self._out_runs -= op.runs
            if self._closed is None:
                self._admit()
        op.state = _OP_DONE
        op.out = None  # op and its frame refer to each other: left alone they wait for the cyclic GC

    def abandon(self, ops: list[_Op]) -> None:
        """The caller gave up: unsent frames are dropped, late payload is discarded (none lands in
        the caller's memory once this returns)."""
        if self._rx_job is not None and not set(ops).isdisjoint([self._payload_op, *self._rx_chain]):
            self._stop_rx()  # the reader then discards the rest
        job = self._tx_job
        if job is not None and not {op.out for op in ops}.isdisjoint(self._tx_outs[self._tx_done + 1 :]):
            job.stop()  # a joined send took writes of these: take back those it has not begun
            self._tx_job = None
            self._settle_tx(job)
        for op in ops:
            op.abandoned = True
            out = op.out
            if out is None or op.state == _OP_DONE:
                continue
            if op.state == _OP_BACKLOG:
                op.state = _OP_DONE  # _admit skips it
                op.out = None  # as in _retire: no cycle left for the collector
                self._dropped(out)
                self._backlog_dead += 1
            elif out.idx == -1 and self._pending.get(op.req_id) is op:
                try:
                    self._sendq.remove(out)
                except ValueError:
                    continue
                del self._pending[op.req_id]
                self._dropped(out)
                self._retire(op)
        self._compact()
        if job is not None and self._tx_job is None and self._closed is None:
            self._flush()  # the send stopped above goes on without them

    # ---------------------------------------------------------------- sending
    def _dropped(self, out: _Out) -> None:
        """``out`` will never be sent (or was sent): release what it holds, once."""
        if out.pinned is not None:
            out.pinned.unpin(self)
            out.pinned = None
        done = out.on_done
        if done is not None:
            out.on_done = None
            done()

    def _send(self, out: _Out) -> None:
        if self._closed is not None:
            self._dropped(out)
            return
        self._sendq.append(out)
        self._flush()

    def _flush(self) -> None:
        if self._tx_job is not None:  # a worker thread is sending the head frame; the rest waits (stream order)
            if self._tx_outs and not self._tx_cut and self._sendq and not _joinable(self._sendq[-1]):
                self._cut_tx()  # but not behind every response the job took: only the one it is in
            return
        _beside(self._rx_job if self._sendq else None, self._send_queue)

    def _send_queue(self) -> None:
        sock = self._sock
        budget = SEND_BUDGET
        q = self._sendq
        while q and budget > 0:
            out = q[0]
            cur = out.cursor
            if cur is not None:
                left = cur.left
            elif out.runs is not None:  # a payload from a run table: the header goes with it
                cur = out.cursor = _frame_cursor(out.bufs, out.runs)
                out.runs = None
                left = cur.left
            else:  # a small frame (few buffers, at most a chunk) is offered whole, without a cursor
                left = sum(map(len, out.bufs))  # byte-formatted memoryviews
                if len(out.bufs) > SMALL_FRAME_BUFS or left > CHUNK_BYTES:
                    cur = out.cursor = _Cursor(out.bufs)
            small = cur is None
            if self._workers is not None and (
                    left >= self._thread_bytes or (cur is not None and cur.runs_left > THREAD_RUNS)):
                self._start_tx(out, cur or _Cursor(out.bufs))  # a large payload: on a worker thread
                return
            try:
                if cur is None:  # a small frame: offer it whole, no cursor unless it is cut short
                    want = left
                    n = sock.sendmsg(out.bufs)
                else:
                    n, want = cur.send(sock)
            except (BlockingIOError, InterruptedError):
                break  # the writer callback resumes once the socket has room
            except OSError as exc:
                self._fail(LLMLinkFailed(f"data connection send failed: {exc}"))
                return
            budget -= n
            if small:
                if n == want:  # sent whole
                    self._sent(out)
                    continue
                cur = out.cursor = _Cursor(out.bufs)
            assert cur is not None
            cur.advance(n)
            out.idx = max(out.idx, 0)  # stays -1 until a byte of the frame is sent
            if cur.done:
                self._sent(out)
            if n < want:
                break
        if q and not self._writer_on and self._closed is None:
            self._loop.add_writer(self._fd, self._flush)
            self._writer_on = True
        elif not q and self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False

    def _offer(self, bufs: list[Any]) -> int:
        """One ``sendmsg`` of a small frame ahead of an empty queue: the bytes the kernel took. 0 on
        EAGAIN or an error, which the queue's own send then meets and reports."""
        try:
            return self._sock.sendmsg(bufs)
        except OSError:
            return 0

    def _sent(self, out: _Out) -> None:
        """The head frame is wholly sent: retire it."""
        self._sendq.popleft()
        out.bufs = []
        out.cursor = None
        self._dropped(out)

    def _start_tx(self, out: _Out, cur: _Cursor | IovCursor) -> None:
        """Hand the rest of the head frame to a worker thread (kvflow._pump); ``_tx_back`` resumes."""
        assert self._workers is not None
        out.cursor = cur
        out.idx = max(out.idx, 0)  # bytes of it go out from now on: it can no longer be dropped
        if self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False
        pool = self._workers()
        job = self._join_tx(out, cur) if pool.native and _bulk(out) else None
        job = self._tx_job = job or pump.Job(cur, cur.left)
        fut = pool.send(self._sock, job)
        fut.add_done_callback(partial(self._back, self._tx_back, job))

    def _join_tx(self, out: _Out, cur: _Cursor | IovCursor) -> pump.Job | None:
        """One job for the head response ``out`` and the large responses queued behind it, none of
        them begun (``_joinable``): a worker sends them end to end without a loop turn between
        frames. None when nothing waits behind the head."""
        outs, heads, addrs, lens, ends = [out], [], [], [], []
        at = cur.left
        for nxt in islice(self._sendq, 1, None):
            if at >= JOIN_BYTES or nxt.idx != -1 or nxt.cursor is not None or not _joinable(nxt):
                break
            bufs = [b if isinstance(b, np.ndarray) else np.frombuffer(b, np.uint8) for b in nxt.bufs]
            heads += bufs
            addrs.append(np.array([b.ctypes.data for b in bufs], np.uint64))
            lens.append(np.array([b.nbytes for b in bufs], np.uint64))
            ends.append(at)
            at += int(lens[-1].sum())
            if nxt.runs is not None:  # a payload sent straight from its run table
                addrs.append(nxt.runs[0])
                lens.append(nxt.runs[1])
                at += int(nxt.runs[1].sum(dtype=np.uint64))
            outs.append(nxt)
        if len(outs) == 1:
            return None
        ends.append(at)
        head_addrs, head_lens = cur.as_iov().rest()
        n = head_addrs.size + sum(a.size for a in addrs)
        arena = self._tx_table_arena(n)
        table = IovCursor(np.concatenate([head_addrs, *addrs], out=arena[3 * n : 4 * n]),
                          np.concatenate([head_lens, *lens], out=arena[4 * n :]), CHUNK_BYTES,
                          keep=(cur, heads), few_searches=True, arena=arena)
        for nxt in outs[1:]:
            nxt.idx = 0  # begun: not to be dropped or replaced unless the job is stopped first (_settle_tx)
        self._tx_outs, self._tx_ends, self._tx_done, self._tx_cut = outs, ends, 0, False
        return pump.Job(table, at, np.array(ends[:-1], np.int64))  # frame starts: where it yields a thread

    def _tx_table_arena(self, n: int) -> np.ndarray:
        """Memory for a joined send's table of ``n`` runs (its runs, iovecs and run ends), kept for the
        next: at most one send job runs per channel, and a new one starts only once the last is done
        or stopped. Fresh arrays for 16k runs cost the loop about 0.5 ms of first touches per join.
        Past TX_ARENA_RUNS, fresh memory not kept: a channel keeps at most 2.5 MiB for this."""
        if n > TX_ARENA_RUNS:
            return np.empty(5 * n, np.uint64)
        if self._tx_arena.size < 5 * n:
            self._tx_arena = np.empty(5 << max(n - 1, 0).bit_length(), np.uint64)
        return self._tx_arena[: 5 * n]

    def _tx_moved(self, job: pump.Job) -> int:
        """Bytes of the joined send ``job`` gone to the kernel; the frames they complete are retired.
        The job may still run: its table is left alone (``Job.moved``, not ``sync``)."""
        moved = job.moved()
        outs, ends, k = self._tx_outs, self._tx_ends, self._tx_done
        while k < len(outs) and ends[k] <= moved:
            self._sent(outs[k])  # the head of the queue: joined frames lead it in order
            k += 1
        self._tx_done = k
        return moved

    def _cut_tx(self) -> None:
        """A frame that is not a large response waits behind the joined send: end the job with the
        frame it is in, and put the frame in line there (``_settle_tx``)."""
        job = self._tx_job
        assert job is not None
        job.hold()  # the worker pauses, so that what it has sent and the cut agree
        try:
            moved = self._tx_moved(job)
            k = self._tx_done
            if k < len(self._tx_outs):
                start = self._tx_ends[k - 1] if k else 0
                job.cut(self._tx_ends[k] if moved > start else moved)
            self._tx_cut = True
        finally:
            job.release()

    def _settle_tx(self, job: pump.Job) -> None:
        """The joined send ``job`` ended (or was stopped): retire what it sent; the frame it was in
        goes on from its own cursor; those it did not begin are as if never joined, and after a cut
        they go behind the frames that waited for it."""
        moved = self._tx_moved(job)
        outs, ends, k = self._tx_outs, self._tx_ends, self._tx_done
        self._tx_outs, self._tx_ends = [], []
        if k == len(outs):
            return
        start = ends[k - 1] if k else 0
        first = k
        if moved > start or k == 0:
            out = outs[k]
            if out.cursor is None:
                out.cursor = _frame_cursor(out.bufs, out.runs) if out.runs is not None else _Cursor(out.bufs)
                out.runs = None
            out.cursor.advance(moved - start)
            first = k + 1
        for out in outs[first:]:
            out.idx = -1
        if self._tx_cut and first < len(outs):
            q = self._sendq
            untouched = [q[i] for i in range(first - k, len(outs) - k)]
            for _ in untouched:
                del q[first - k]
            q.extend(untouched)

    def _back(self, resume: Callable[[pump.Job, Future[None]], None], job: pump.Job, fut: Future[None]) -> None:
        """A worker thread finished with ``job``: resume on the loop thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to resume
            self._loop.call_soon_threadsafe(resume, job, fut)

    def _tx_back(self, job: pump.Job, fut: Future[None]) -> None:
        if job is not self._tx_job:
            return  # stopped by teardown
        self._tx_job = None
        exc = fut.exception()
        if exc is not None:
            self._fail(LLMLinkFailed(f"data connection send failed: {exc}"))
            return
        if self._tx_outs:
            self._settle_tx(job)
            head = self._sendq[0] if self._sendq else None
            if head is None or head.cursor is None or head.idx == -1 or head.cursor.done:
                self._flush()
            elif self._closed is None and not self._writer_on:
                self._loop.add_writer(self._fd, self._flush)
                self._writer_on = True
        elif job.cursor.done:
            self._sent(self._sendq[0])
            self._flush()
        elif self._closed is None and not self._writer_on:  # handed back on a full socket: resume once
            self._loop.add_writer(self._fd, self._flush)   # it has room, not on a thread polling it
            self._writer_on = True

    # ---------------------------------------------------------------- receiving
    def _expect_soon(self) -> None:
        """A frame is due within microseconds (the response to a small request of ours, or the
        peer's next request after we served one): for up to ``busy_poll`` seconds, read the
        socket from a loop callback instead of letting the loop sleep in epoll. Waking a sleeping
        process costs tens of microseconds on a VM; other callbacks still run in between."""
        if self._busy_poll <= 0.0:
            return
        self._poll_until = time.perf_counter() + self._busy_poll
        if not self._polling:
            self._polling = True
            self._loop.call_soon(self._poll)

    def _next_request_soon(self) -> None:
        """We serve a small request of the peer's: poll for its next one too, but only while the
        peer asks often. Requests that came further apart than the poll lasts would each cost a
        whole window of CPU for nothing (at 600 requests/s that was 8 % of a core): then the loop
        sleeps in epoll between them and only our own replies are polled for."""
        now = time.perf_counter()
        gap = now - self._last_request
        self._last_request = now
        if gap <= self._busy_poll:
            self._expect_soon()

    def _poll(self) -> None:
        if self._closed is not None or time.perf_counter() > self._poll_until:
            self._polling = False
            return
        self._on_readable()
        self._loop.call_soon(self._poll)

    def _on_readable(self) -> None:
        if self._rx_job is not None:
            return  # a worker thread is reading a payload (the busy poll may still call)
        _beside(self._tx_job, self._read)

    def _read(self) -> None:
        sock = self._sock
        budget = RECV_BUDGET
        try:
            while budget > 0:
                st = self._state
                if st == _ST_HDR:
                    got = self._got
                    # With no request of ours pending, the next frame is a request of the peer's (or a
                    # protocol error): it has a run after its header, so reading that run too cannot
                    # take a byte of the frame after it.
                    want = (_HDR_RUN if not self._pending else _HDR_SIZE) - got
                    n = sock.recv_into(self._hdr_mv[got:], want)
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    got += n
                    if got < _HDR_SIZE:
                        self._got = got
                        continue
                    self._got = 0
                    self._on_header(got - _HDR_SIZE)
                    if self._state == _ST_HDR:
                        return  # a whole frame: let the loop call again (level-triggered) if more waits
                elif st == _ST_RUNS:
                    if self._got < len(self._runs_mv):  # the first run may have come with the header
                        n = sock.recv_into(self._runs_mv[self._got :])
                        if n == 0:
                            raise ConnectionResetError("peer closed the data connection")
                        self._got += n
                    if self._got == len(self._runs_mv):
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
                    cur = self._rx
                    if self._workers is not None and (self._left >= self._thread_bytes or cur.runs_left > THREAD_RUNS):
                        self._start_rx()
                        return
                    n = cur.recv(sock)
                    if n == 0:
                        raise ConnectionResetError("peer closed the data connection")
                    budget -= n
                    self._left -= n
                    cur.advance(n)
                    if self._left == 0:
                        self._payload_done()
                        return
                else:  # discard
                    n = sock.recv_into(_SCRATCH, min(self._left, len(_SCRATCH)))
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

    def _start_rx(self, chain: list[_Op] | None = None) -> None:
        """Hand the rest of the payload (and the reads ``_chain`` finds, or ``chain``) to a worker
        thread (kvflow._pump); ``_rx_back`` resumes."""
        assert self._workers is not None
        self._loop.remove_reader(self._fd)
        pool = self._workers()
        if chain is None:
            chain = self._chain() if pool.native else []
        if chain:
            job = self._chain_rx(chain)
        else:
            job = (self._serve_rx() if pool.native else None) or pump.Job(self._rx, self._left)
        self._rx_job = job
        self._rx_chain = chain
        fut = pool.receive(self._sock, job)
        fut.add_done_callback(partial(self._back, self._rx_back, job))

    def _chain(self) -> list[_Op]:
        """Our pending reads whose responses, if the peer answers in order as it does, come next
        after the payload of our read in hand (or next on the stream, between frames): up to
        CHAIN_BYTES."""
        op = self._payload_op
        if self._state == _ST_PAYLOAD and (op is None or op.kind != READ_REQ or op.abandoned):
            return []
        chain: list[_Op] = []
        at = self._left
        for nxt in self._pending.values():
            if at >= CHAIN_BYTES or nxt.kind != READ_REQ or nxt.abandoned or not nxt.dests:
                break
            chain.append(nxt)
            at += _HDR_SIZE + nxt.nbytes
        return chain

    def _chain_next(self) -> None:
        """A chained receive read all it was given: if more large responses are due, the next job
        starts at their first header, without waiting for the loop to see it arrive."""
        if self._closed is not None or self._state != _ST_HDR or self._got or self._workers is None:
            return
        chain = self._chain() if self._workers().native else []
        if chain and sum(op.nbytes for op in chain) >= self._thread_bytes:
            self._start_rx(chain)

    def _chain_rx(self, chain: list[_Op]) -> pump.Job:
        """One receive job for the payload in hand and then, for each read in ``chain``, its
        response's header (into a slot, checked by the C loop against the one we expect) and
        payload. The first header that differs ends the job; the loop acts on it (``_settle_rx``)."""
        slots = self._rx_slots = np.zeros((len(chain), _HDR_SIZE), np.uint8)
        base = slots.ctypes.data
        head_addrs, head_lens = self._rx.as_iov().rest()
        addrs, lens = [head_addrs], [head_lens]
        marks = np.empty(len(chain), np.int64)
        expect = []
        at = self._left
        keep: list[Any] = [self._rx, slots]
        for k, op in enumerate(chain):
            dests = op.dests
            if not isinstance(dests, tuple):  # byte views (a few runs): their addresses
                views = [np.frombuffer(d, np.uint8) for d in dests or ()]
                keep.append(views)
                dests = (np.array([v.ctypes.data for v in views], np.uint64),
                         np.array([v.size for v in views], np.uint64))
            addrs += [np.array([base + k * _HDR_SIZE], np.uint64), dests[0]]
            lens += [_HDR_LEN, dests[1]]
            at += _HDR_SIZE
            marks[k] = at
            at += op.nbytes
            expect.append(HDR.pack(READ_RSP, 0, 0, 0, op.req_id, 0, op.nbytes))
        self._rx_bytes = at
        table = IovCursor(np.concatenate(addrs), np.concatenate(lens), CHUNK_BYTES, keep=keep, few_searches=True)
        return pump.Job(table, at, marks, base + np.arange(len(chain), dtype=np.uint64) * np.uint64(_HDR_SIZE),
                        b"".join(expect))

    def _serve_rx(self) -> pump.Job | None:
        """A receive job for the rest of the peer's write in hand that then goes on through the
        writes after it into the same host cache, each header and run table checked in C
        (``kvf_serve``) by a strict subset of the loop's own checks, before any byte of its payload
        is read; ``_settle_serve`` places what it read. None when the payload is not such a write."""
        local = self._payload_pin
        if self._state != _ST_PAYLOAD or self._payload_op is not None or local is None or \
                local.regions[0].view is None or not iov.AVAILABLE:
            return None
        frames = MAX_OUTSTANDING_FRAMES - self._serving_frames
        runs = MAX_OUTSTANDING_RUNS - self._serving_runs
        if frames <= 0 or runs <= 0:
            return None
        hdrs = np.empty(frames * _HDR_SIZE, np.uint8)
        tables = np.empty(runs * RUN.itemsize, np.uint8)
        scratch = np.empty(MAX_RUNS * RUN.itemsize, np.uint8)
        serve = pump.Serve(local.cache_id, local.starts.ctypes.data, local.sizes.ctypes.data, local.starts.size,
                           frames, runs, SERVE_BYTES, POLL_BYTES, MAX_FRAME_BYTES, MAX_RUNS, hdrs.ctypes.data,
                           tables.ctypes.data, scratch.ctypes.data, local.closing_flag.ctypes.data)
        serve.keep = (local.starts, local.sizes, hdrs, tables, scratch, local.closing_flag)
        return pump.Job(self._rx, self._left, serve=serve)

    def _settle_serve(self, job: pump.Job) -> None:
        """The ``_serve_rx`` job ended or was stopped: answer the writes that landed whole, and put
        the reader where the job left the stream (in a header, a run table or a payload), through
        the loop's own steps (``_on_header``, ``_on_runs``) for a frame it did not finish."""
        assert job.serve is not None
        rest = job.moved() - job._total  # bytes past the first payload (``job.left`` counts that one)
        self._left = job.left
        if self._left:
            return
        self._payload_done()
        _starts, _sizes, hdrs, tables, *_ = job.serve.keep
        frames = runs = at = 0
        answers: list[bytes] = []
        while rest >= _HDR_SIZE:  # the writes that landed whole: checked in C, answered now
            _kind, _f, _r, count, req_id, _cache, total = HDR.unpack_from(hdrs, frames * _HDR_SIZE)
            whole = _HDR_SIZE + count * RUN.itemsize + total
            if rest < whole:
                break
            answers.append(HDR.pack(WRITE_RSP, 0, 0, 0, req_id, 0, 0))
            frames += 1
            runs += count
            at += count * RUN.itemsize
            rest -= whole
        if answers:
            self._serving_frames += frames
            self._serving_runs += runs
            self._send(_Out([b"".join(answers)], on_done=self._served(runs, frames)))
        if rest <= 0 or self._closed is not None:
            return
        got = min(rest, _HDR_SIZE)  # the frame the job was in, as the reader would have read it
        self._hdr_mv[:got] = hdrs[frames * _HDR_SIZE : frames * _HDR_SIZE + got].data
        rest -= got
        if got < _HDR_SIZE:
            self._got = got
            return
        self._on_header()
        if self._state != _ST_RUNS:
            return
        n = min(rest, len(self._runs_mv))
        self._runs_mv[:n] = tables[at : at + n].data
        self._got = n
        rest -= n
        if n < len(self._runs_mv):
            return
        self._got = 0
        self._on_runs()
        if rest and self._state in (_ST_PAYLOAD, _ST_DISCARD):
            self._left -= rest
            if self._state == _ST_PAYLOAD:
                self._rx.advance(rest)

    def _settle_rx(self, job: pump.Job, chain: list[_Op]) -> None:
        """The chained receive ``job`` ended or was stopped: the reads it completed are done; the
        read it was in, or the header it was in or found different, goes on in the reader."""
        moved = self._rx_bytes - job.left
        if self._state == _ST_PAYLOAD:  # the job began in the payload of a read
            if moved < self._left:
                self._left -= moved
                self._rx.advance(moved)
                return
            moved -= self._left
            self._left = 0
            self._payload_done()
        for k, op in enumerate(chain):
            if self._closed is not None:
                return  # a send that what we retired started has failed the link: the teardown has the rest
            if moved < _HDR_SIZE or k >= job.passed:  # a header partly here, or not the one expected
                got = min(moved, _HDR_SIZE)
                self._hdr_mv[:got] = self._rx_slots[k, :got].data
                self._got = 0 if got == _HDR_SIZE else got
                if got == _HDR_SIZE:
                    self._on_header()
                return
            moved -= _HDR_SIZE
            del self._pending[op.req_id]  # as the reader does once it has a response's header
            if moved < op.nbytes:
                self._read_rest(op, op.dests, op.nbytes, moved)
                return
            moved -= op.nbytes
            op.xfer.frame_done()
            self._retire(op)

    def _stop_rx(self) -> None:
        """Take the payload back from its worker thread now: once this returns, the thread writes
        no further byte (a syscall in progress, at most ``CHUNK_BYTES``, is waited out)."""
        job = self._rx_job
        if job is None:
            return
        job.stop()
        self._rx_resume(job)  # if the thread had read it all, its queued hand-back is now ignored

    def _rx_back(self, job: pump.Job, fut: Future[None]) -> None:
        if job is not self._rx_job:
            return  # taken back earlier (_stop_rx)
        exc = fut.exception()
        if exc is not None:
            self._rx_job = None
            self._fail(LLMLinkFailed(f"data connection lost: {exc}"))
            return
        # The reader (level-triggered) resumes the payload once bytes wait: a payload handed back
        # on an empty socket (a stalled peer) then waits in epoll, not on a thread polling for it.
        self._rx_resume(job)

    def _rx_resume(self, job: pump.Job) -> None:
        """The loop reads again from where the stopped or returned ``job`` left the payload."""
        self._rx_job = None
        chain, self._rx_chain = self._rx_chain, []
        if self._closed is None:
            self._loop.add_reader(self._fd, self._on_readable)
        if chain or job.serve is not None:
            try:
                if chain:
                    self._settle_rx(job, chain)
                else:
                    self._settle_serve(job)
            except LLMException as exc:  # the header (or run table) that ended the job is a bad one
                self._fail(exc)
            except OSError as exc:
                self._fail(LLMLinkFailed(f"data connection lost: {exc}"))
            if chain and job.left == 0 and not job.stopped:
                self._chain_next()
            return
        self._left = job.left
        if self._left == 0:
            self._payload_done()

    def _expect_payload(self, dests: Payload | None, nbytes: int, done: Callable[[], None],
                        op: _Op | None = None, pin: LocalCache | None = None, req_id: int = 0) -> None:
        self._left = nbytes
        self._on_payload = done
        self._payload_op = op
        self._payload_pin = pin
        self._payload_req = req_id
        if nbytes == 0:
            self._state = _ST_HDR
            done()
        elif dests is None:
            self._state = _ST_DISCARD
        else:
            self._rx = _cursor(dests)
            self._state = _ST_PAYLOAD

    def _payload_done(self) -> None:
        done = self._on_payload
        self._state = _ST_HDR
        self._on_payload = None
        self._payload_op = None
        self._payload_pin = None
        self._payload_req = 0
        self._payload_served = None
        self._rx = _NO_CURSOR
        if done is not None:
            done()

    def _protocol_error(self, what: str) -> None:
        raise LLMLinkFailed(f"protocol error from peer: {what}")

    def _on_header(self, run_got: int = 0) -> None:
        """Act on the header in ``_hdr``; ``run_got`` bytes of a request's first run follow it there.
        Those only come when nothing of ours was pending, and then any frame but a request is a
        response to nothing, which the branches below refuse."""
        kind, _flags, _res, count, req_id, arg, total = HDR.unpack_from(self._hdr)
        self._cur = (kind, count, req_id, arg, total)
        if kind in (READ_REQ, WRITE_REQ):
            if not 0 < count <= MAX_RUNS or total > MAX_FRAME_BYTES:
                self._protocol_error(f"request with {count} runs / {total} bytes")
            if self._tx_outs and self._tx_job is not None:
                self._tx_moved(self._tx_job)  # responses a joined send has sent count as answered
            if self._serving_frames and (self._serving_frames >= MAX_OUTSTANDING_FRAMES
                                         or self._serving_runs + count > MAX_OUTSTANDING_RUNS):
                self._protocol_error(f"more than {MAX_OUTSTANDING_FRAMES} requests / {MAX_OUTSTANDING_RUNS} runs "
                                     "outstanding")
            self._serving_frames += 1
            self._serving_runs += count
            if count <= SMALL_RUNS:  # reuse one small buffer: most requests are a few runs
                self._runs_mv = self._runs_small[: count * RUN.itemsize]
            else:
                self._runs_mv = memoryview(bytearray(count * RUN.itemsize))
            self._runs_mv[:run_got] = self._hdr_mv[_HDR_SIZE : _HDR_SIZE + run_got]
            self._got = run_got
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
                self._retire(op)
                return
            if total != op.nbytes:
                self._protocol_error(f"read {req_id}: {total} bytes, expected {op.nbytes}")
            dests = None if op.abandoned else op.dests
            got = 0
            if type(dests) is list and 0 < total <= POLL_BYTES:  # a small payload, most often here already
                try:
                    got = self._payload_now(dests)
                except OSError:
                    self._payload_op = op  # out of _pending already: the teardown fails it from here
                    raise
                if got == total:  # read whole in the one call: no cursor, no payload state
                    op.xfer.frame_done()
                    self._retire(op)
                    return
            self._read_rest(op, dests, total, got)
        elif kind == WRITE_RSP:
            op = self._pending.pop(req_id, None)
            if op is None or op.kind != WRITE_REQ:
                self._protocol_error(f"response to unknown write {req_id}")
            assert op is not None
            if total:
                self._protocol_error("write response carries payload")
            if arg != 0:
                op.xfer.fail(error_for(arg, f"peer refused write: {LLMStatusCode.of(arg).name}"))
            else:
                op.xfer.frame_done()
            self._retire(op)
        else:
            self._protocol_error(f"unknown frame kind {kind}")

    def _read_rest(self, op: _Op, dests: Payload | None, total: int, got: int) -> None:
        """The reader's payload state takes over our read ``op``'s reply, ``got`` of its ``total``
        payload bytes already in ``dests`` (None: discard it, the caller gave up)."""

        def read_done(op: _Op = op) -> None:
            op.xfer.frame_done()
            self._retire(op)

        self._expect_payload(dests, total, read_done, op)
        if got:
            self._left -= got
            self._rx.advance(got)

    def _check(self, cache_id: int, count: int, total: int) -> tuple[LocalCache, Payload]:
        """The named cache and the runs of the peer's request in it, every run checked."""
        local = self._registry.get(cache_id)
        if count <= SMALL_RUNS:
            pairs = _SMALL_RUNS_TABLES[count].unpack_from(self._runs_mv)
            run_lens = list(pairs[1::2])
            if sum(run_lens) != total:
                raise LLMParamInvalid("run lengths do not add up to the payload size")
            return local, local.views_small(list(pairs[0::2]), run_lens)
        table = np.frombuffer(self._runs_mv, dtype=RUN, count=count)
        addrs, lens = table["addr"], table["len"]  # a large table has a buffer of its own
        if int(lens.sum(dtype=np.uint64)) != total:
            raise LLMParamInvalid("run lengths do not add up to the payload size")
        if not iov.AVAILABLE:
            return local, local.views(addrs, lens)
        local.locate(addrs, lens)  # raises unless every run lies inside one registered tensor
        local.check_host()
        return local, (addrs, lens)

    def _served(self, runs: int, frames: int = 1) -> Callable[[], None]:
        """What runs once the response to ``frames`` requests of the peer's, ``runs`` runs in all, is
        wholly sent."""

        def served() -> None:
            self._serving_frames -= frames
            self._serving_runs -= runs

        return served

    def _write_rsp(self, req_id: int, status: int, served: Callable[[], None]) -> Callable[[], None]:
        return lambda: self._send(_Out([HDR.pack(WRITE_RSP, 0, 0, 0, req_id, status, 0)], on_done=served))

    def _on_runs(self) -> None:
        kind, count, req_id, cache_id, total = self._cur
        self._state = _ST_HDR
        served = self._served(count)
        try:
            local, views = self._check(cache_id, count, total)
        except LLMException as exc:
            status = int(exc.status_code)
            log.debug("refusing peer request %d on cache %d: %s", req_id, cache_id, exc)
            if kind == READ_REQ:
                self._send(_Out([HDR.pack(READ_RSP, 0, 0, 0, req_id, status, 0)], on_done=served))
            else:
                self._expect_payload(None, total, self._write_rsp(req_id, status, served))
            return
        if total <= POLL_BYTES:
            self._next_request_soon()
        if kind == READ_REQ:
            head = HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, total)
            sent = 0
            if type(views) is list and total <= POLL_BYTES and not self._sendq and self._tx_job is None:
                sent = self._offer([head, *views])  # a small reply, most often taken whole: nothing to queue
                if sent == _HDR_SIZE + total:
                    served()
                    return
            local.pin(self)
            self._send_rest(_Out([head], views, on_done=served, pinned=local, rsp_req=req_id), sent)
        else:
            got = 0
            if type(views) is list and total <= POLL_BYTES:  # a small write, most often all here already
                got = self._payload_now(views)
                if got == total:  # landed whole in the one call: answer it, ahead of the queue if we may
                    rsp_head = HDR.pack(WRITE_RSP, 0, 0, 0, req_id, 0, 0)
                    sent = self._offer([rsp_head]) if not self._sendq and self._tx_job is None else 0
                    if sent == _HDR_SIZE:
                        served()
                    else:
                        self._send_rest(_Out([rsp_head], on_done=served), sent)
                    return
            local.pin(self)
            rsp = self._write_rsp(req_id, 0, served)

            def done() -> None:
                local.unpin(self)
                rsp()

            self._expect_payload(views, total, done, pin=local, req_id=req_id)
            self._payload_served = served
            if got:
                self._left -= got
                self._rx.advance(got)

    # ---------------------------------------------------------------- teardown
    def _fail(self, exc: BaseException) -> None:
        if self._closed is not None:
            return
        self._closed = exc
        self._teardown(exc)
        self._on_broken(exc)

    def _teardown(self, exc: BaseException) -> None:
        for job in (self._rx_job, self._tx_job):  # no worker touches our memory or the socket after this
            if job is not None:
                job.stop()
        self._rx_job = self._tx_job = None
        self._tx_outs, self._tx_ends, self._rx_chain = [], [], []
        try:
            self._loop.remove_reader(self._fd)
            if self._writer_on:
                self._loop.remove_writer(self._fd)
        except Exception:  # loop already closed
            pass
        self._writer_on = False
        self._state = _ST_HDR
        self._on_payload = None
        self._rx = _NO_CURSOR
        if self._payload_pin is not None:  # a peer's write into our memory was cut short
            self._payload_pin.unpin(self)
            self._payload_pin = None
        if self._payload_op is not None:  # the payload of our read was cut short
            self._payload_op.xfer.fail(exc)
            self._payload_op = None
        sendq, self._sendq = self._sendq, deque()
        for out in sendq:
            self._dropped(out)
        pending, self._pending = self._pending, {}
        for op in pending.values():
            op.state, op.out = _OP_DONE, None
            op.xfer.fail(exc)
        backlog, self._backlog = self._backlog, deque()
        for op in backlog:
            if op.state != _OP_DONE and op.out is not None:
                op.state = _OP_DONE
                self._dropped(op.out)
            op.out = None
            op.xfer.fail(exc)
        self._sock.close()

    def close(self, exc: BaseException | None = None) -> None:
        if self._closed is None:
            self._closed = exc or LLMLinkFailed("link closed")
            self._teardown(self._closed)

    def revoke(self, local: LocalCache, exc: LLMException) -> None:
        """``local`` is being unregistered and its deadline passed: stop every operation of the peer's
        on it now, so that none reads or writes its memory afterwards.

        A response to the peer's read not yet started is replaced by an error (``exc``'s code); a
        peer's write landing in it goes on into a discard buffer and is answered with that code. A
        frame already partly sent from its memory (a response, or a write of ours whose caller gave
        up) cannot be taken back without desynchronising the stream: then the data connection is
        closed and the link is marked broken. Writes of ours whose callers still wait are left
        alone: those are local transfers, which ``unregister_kv_cache`` reports."""
        if self._closed is not None:
            return
        code = int(exc.status_code)
        cut = replaced = False
        job = self._tx_job
        if job is not None and any(out.pinned is local for out in self._tx_outs):
            job.stop()  # a joined send: take back the responses it has not begun
            self._tx_job = None
            self._settle_tx(job)
        for out in self._sendq:
            if out.pinned is not local:
                continue
            if out.rsp_req is not None:  # our response to the peer's read
                if out.idx >= 0:
                    cut = True
                else:
                    out.bufs = [HDR.pack(READ_RSP, 0, 0, 0, out.rsp_req, code, 0)]
                    out.runs = None
                    out.cursor = None  # one made over the old reply by a send that got EAGAIN
                    local.unpin(self)
                    out.pinned = None
                    replaced = True
            elif out.op is not None and out.op.abandoned and out.idx >= 0:
                cut = True
        if self._payload_pin is local:
            self._stop_rx()  # finishes the payload if the thread had read it all
        if self._payload_pin is local:  # the peer's write lands in it: discard the rest, answer with the error
            local.unpin(self)
            self._payload_pin = None
            self._state = _ST_DISCARD
            self._rx = _NO_CURSOR
            assert self._payload_served is not None
            self._on_payload = self._write_rsp(self._payload_req, code, self._payload_served)
        if cut:
            self._fail(LLMLinkFailed(f"data connection closed: cache {local.cache_id} was unregistered "
                                     f"while a transfer was still using it ({exc})"))
        elif job is not None and self._tx_job is None:
            self._flush()  # the send stopped above goes on, with the errors in place of the replies
        elif replaced and self._tx_outs and not self._tx_cut:
            self._cut_tx()  # an error in place of a reply queued behind a joined send: after one frame


class TcpEndpoint(Endpoint):
    """The TCP data path of one link."""

    #: The peer moves the bytes of our requests itself (two-sided): a peer unregistering a cache
    #: stops our operations on it on its side, so the core need not abort this endpoint for it.
    one_sided = False
    #: Runs per batch: the core keeps two batches in flight, and a receive job chains only what is in
    #: flight, so 8192 runs of 16 KiB (the default) woke the loop every 128 MiB. Not more: the peer
    #: counts a response as outstanding until its loop sees the send end, which may come after our
    #: next request (with two batches at the bound, that race would break the link).
    max_runs = MAX_RUNS  # two batches in flight are half the peer's bound on runs (MAX_OUTSTANDING_RUNS)

    def __init__(self, channel: TcpChannel) -> None:
        self._ch = channel

    async def _run(self, kind: int, batch: RunBatch) -> None:
        n = len(batch)
        if n <= SUBMIT_RUNS:
            await self._ch.wait(*self._ch.submit(kind, batch))
            return
        # Framing costs about 0.1 ms per frame of runs on this thread: a long batch is submitted a
        # few frames at a time, with the loop free in between (the first frames are moving already).
        xfers: list[_Transfer] = []
        ops = []
        try:
            for a in range(0, n, SUBMIT_RUNS):
                if xfers:
                    await asyncio.sleep(0)
                # the runs' rows, not a copy (each row of the slice is contiguous)
                part = RunBatch.of_table(batch.table[:, a : a + SUBMIT_RUNS], batch.local_cache, batch.remote_cache)
                xfer, more = self._ch.submit(kind, part)
                xfers.append(xfer)
                ops.extend(more)
            for xfer in xfers:
                await xfer.fut
        except BaseException:
            self._ch.abandon(ops)
            raise

    async def read(self, batch: RunBatch) -> None:
        await self._run(READ_REQ, batch)

    async def write(self, batch: RunBatch) -> None:
        await self._run(WRITE_REQ, batch)

    def read_now(self, batch: RunBatch) -> bool | Started:
        moved = self._ch.now(READ_REQ, batch)
        return moved if isinstance(moved, Started) else moved is not None

    def write_now(self, batch: RunBatch) -> bool | Started:
        moved = self._ch.now(WRITE_REQ, batch)
        return moved if isinstance(moved, Started) else moved is not None

    def blocks_now(self, write: bool, local: LocalCache, remote: RemoteCache, src_blocks: list[int] | tuple[int, ...],
                   dst_blocks: list[int] | tuple[int, ...]) -> tuple[int, int] | Started | None:
        """A small block transfer planned by the core's planner (``small_block_rows``: Python ints, no
        numpy table) and sent through ``TcpChannel.now_rows``, without the request objects of
        ``read_now``'s path; bad input is declined (the core then raises its typed error)."""
        if not self._ch.idle or len(src_blocks) * local.desc.stride * local.desc.num_tensors > POLL_BYTES:
            return None
        remote_addrs = remote.cache.get(_ADDR_LIST)
        if remote_addrs is None:
            remote_addrs = remote.cache[_ADDR_LIST] = remote.addrs.tolist()
        ours, theirs = (local.desc, local.addr_list), (remote.desc, remote_addrs)
        (src, src_addrs), (dst, dst_addrs) = (ours, theirs) if write else (theirs, ours)
        try:
            rows = small_block_rows(src, src_addrs, dst, dst_addrs, src_blocks, dst_blocks, write)
        except LLMException:
            return None
        if rows is None:
            return None
        return self._ch.now_rows(WRITE_REQ if write else READ_REQ, rows, local, remote.cache_id)

    def abort(self, exc: BaseException) -> None:
        self._ch._fail(exc)  # in-flight operations fail with ``exc``; the link is told (once) it is broken

    async def close(self) -> None:
        self._ch.close()


class TcpTransport(Transport):
    """Framed scatter-gather over a TCP socket; works between any two hosts."""

    name = "tcp"
    option_keys = frozenset({"BusyPollUs", "InlinePollUs", "NativePump", "ThreadBytes", "Threads"})

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.busy_poll = ctx.int_option("kvflow.tcp.BusyPollUs", DEFAULT_BUSY_POLL_US, 0, 100_000) / 1e6
        #: 0 moves every payload on the loop thread
        self.thread_bytes = ctx.int_option("kvflow.tcp.ThreadBytes", DEFAULT_THREAD_BYTES, 0)
        self.threads = ctx.int_option("kvflow.tcp.Threads", DEFAULT_THREADS, 1, 64)
        #: 1 (default): the worker threads move payloads in C where it was built; 0: in Python
        self.native_pump = ctx.int_option("kvflow.tcp.NativePump", 1, 0, 1) == 1
        #: 0: a small transfer always waits for its reply on the loop
        self.inline_poll = min(self.busy_poll,
                               ctx.int_option("kvflow.tcp.InlinePollUs", DEFAULT_INLINE_POLL_US, 0, 100_000) / 1e6)
        self._pool: pump.Pool | None = None

    def _executor(self) -> pump.Pool:
        if self._pool is None:
            self._pool = pump.Pool(self.ctx.worker_pool("kvflow-tcp", self.threads), self.native_pump)
        return self._pool

    async def connect(self, info: Mapping[str, Any], channel: LinkChannel) -> Endpoint:
        sock = await channel.open_stream()
        workers = self._executor if self.thread_bytes else None
        return TcpEndpoint(TcpChannel(sock, self.ctx.registry, channel.broken, self.busy_poll, workers,
                                      self.thread_bytes, self.inline_poll))

    async def close(self) -> None:
        if self._pool is not None:  # every channel has stopped its jobs by now (teardown)
            self._pool.shutdown()
            self._pool = None

