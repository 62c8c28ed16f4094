"""tcp worker jobs that go on from frame to frame without the loop thread (docs/decisions.md,
"tcp: one worker job across frames"): a receive job that reads the responses to our next reads,
each header checked in C before any byte after it, and a send job that sends queued responses end
to end, cut short when anything else waits behind it.

Real loopback sockets and the real C loop (kvflow._pumpc); the far end is either a second channel
in this process or a raw socket driven by the test (to answer out of order, or with a bad header).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvflow import LLMLinkFailed
from kvflow import _pump as pump
from kvflow._iov import IovCursor
from kvflow._memory import LocalCache, Registry
from kvflow._tcp import _ST_HDR, CHUNK_BYTES, HDR, READ_REQ, READ_RSP, RUN, WRITE_REQ, WRITE_RSP, TcpChannel
from kvflow._types import CacheDesc, DataType
from kvflow.transport import RemoteCache, RunBatch

pytestmark = pytest.mark.skipif(not pump.NATIVE, reason="kvflow._pumpc was not built")

BLOCK = 4096
FRAME_BLOCKS = 2048  # kvflow._tcp.FRAME_RUNS: one request frame per 2048 scattered blocks (8 MiB)
FRAMES = 6
BLOCKS = FRAME_BLOCKS * FRAMES


@pytest.fixture
def pool() -> Iterator[pump.Pool]:
    executor = ThreadPoolExecutor(2)
    yield pump.Pool(executor, True)
    executor.shutdown(wait=True)


def _pair() -> tuple[socket.socket, socket.socket]:
    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    return a, b


def _cache(reg: Registry, blocks: int, fill: int | None) -> tuple[LocalCache, np.ndarray]:
    arr = np.zeros(blocks * BLOCK, np.uint8) if fill is None else \
        np.random.default_rng(fill).integers(0, 256, blocks * BLOCK, dtype=np.uint8)
    return reg.add(CacheDesc(1, DataType.DT_UINT8, [blocks, BLOCK]), [arr]), arr


def _read_batch(local: LocalCache, dest: np.ndarray, remote_id: int, remote_base: int, order: np.ndarray,
                spread: int) -> RunBatch:
    """Block ``order[i]`` of the remote cache into local block ``spread * i`` (the blocks between stay 0)."""
    n = order.size
    remote = RemoteCache(2, remote_id, CacheDesc(1, DataType.DT_UINT8, [n, BLOCK]), ())
    local_addrs = int(dest.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(spread * BLOCK)
    remote_addrs = np.uint64(remote_base) + order.astype(np.uint64) * np.uint64(BLOCK)
    zeros = np.zeros(n, np.uint64)
    return RunBatch(local_addrs, remote_addrs, np.full(n, BLOCK, np.uint64), zeros, zeros, local, remote)


def _landed(dest: np.ndarray, src: np.ndarray, order: np.ndarray, spread: int) -> bool:
    """Every block where it belongs, and every byte between them still 0."""
    view = dest.reshape(-1, BLOCK)
    if not np.array_equal(view[::spread][: order.size], src.reshape(-1, BLOCK)[order]):
        return False
    mask = np.ones(view.shape[0], bool)
    mask[::spread][: order.size] = False
    return not view[mask].any()


def _channel(sock: socket.socket, reg: Registry, pool: pump.Pool, broken: list[BaseException]) -> TcpChannel:
    return TcpChannel(sock, reg, broken.append, 0.0, workers=lambda: pool, thread_bytes=64 << 10)


def _watch_settles(ch: TcpChannel) -> list[tuple[int, int, bool]]:
    """Each chained receive the channel settles: (reads chained, headers passed, ended on a header that differed)."""
    seen: list[tuple[int, int, bool]] = []
    settle = ch._settle_rx

    def watched(job: pump.Job, chain: list[Any]) -> None:
        seen.append((len(chain), job.passed, job.mismatch))
        settle(job, chain)

    ch._settle_rx = watched  # type: ignore[method-assign]
    return seen


async def _requests(peer: socket.socket, count: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Read ``count`` read requests off the raw peer socket: (request id, runs) each."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    out: list[tuple[int, list[tuple[int, int]]]] = []
    while len(out) < count:
        while len(buf) < HDR.size:
            buf += await loop.sock_recv(peer, 1 << 20)
        kind, _f, _r, runs, req_id, _cache_id, _total = HDR.unpack_from(buf)
        assert kind == READ_REQ
        need = HDR.size + runs * RUN.itemsize
        while len(buf) < need:
            buf += await loop.sock_recv(peer, 1 << 20)
        pairs = struct.unpack_from(f"<{2 * runs}Q", buf, HDR.size)
        out.append((req_id, list(zip(pairs[0::2], pairs[1::2]))))
        del buf[:need]
    return out


def _reader(pool: pump.Pool) -> tuple[TcpChannel, socket.socket, LocalCache, np.ndarray, list[BaseException],
                                      list[tuple[int, int, bool]]]:
    """Our channel, reading into a zeroed cache twice the reads' size, and a raw peer socket: the
    channel, the peer, the cache and its memory, the broken-link list and the settles seen."""
    ours, peer = _pair()
    peer.setblocking(False)
    reg = Registry()
    local, dest = _cache(reg, 2 * BLOCKS, None)
    broken: list[BaseException] = []
    ch = _channel(ours, reg, pool, broken)
    return ch, peer, local, dest, broken, _watch_settles(ch)


def _answer(src: np.ndarray, req_id: int, runs: list[tuple[int, int]], extra: bytes = b"") -> bytes:
    """A good answer to a read of ``runs`` (offsets into ``src``), ``extra`` bytes appended to its payload."""
    payload = b"".join(src[a : a + n].tobytes() for a, n in runs) + extra
    return HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, len(payload)) + payload


@contextlib.contextmanager
def _linked(pool: pump.Pool) -> Iterator[tuple[TcpChannel, TcpChannel, Registry, Registry, list[BaseException]]]:
    """Channels A (on ``pool``) and B (on a pool of its own) over one loopback connection, their
    registries, and the broken-link list both fill; closed and shut down on the way out."""
    sock_a, sock_b = _pair()
    reg_a, reg_b = Registry(), Registry()
    broken: list[BaseException] = []
    pool_b = pump.Pool(ThreadPoolExecutor(2), True)
    a, b = _channel(sock_a, reg_a, pool, broken), _channel(sock_b, reg_b, pool_b, broken)
    try:
        yield a, b, reg_a, reg_b, broken
    finally:
        a.close()
        b.close()
        pool_b.shutdown()


async def _until_joined(a: TcpChannel) -> None:
    """Until A's worker sends several responses as one job, none of them wholly sent yet."""
    for _ in range(20000):
        if len(a._tx_outs) > 2 and a._tx_done == 0:
            return
        await asyncio.sleep(0.0005)


async def _send_from_thread(peer: socket.socket, data: bytes) -> None:
    """``sendall`` on a thread of its own, so that the bytes come as fast as we read them (a chained
    job that waits 2 ms for the next header ends, and the loop reads the frame instead)."""
    peer.setblocking(True)

    def send() -> None:
        with contextlib.suppress(ConnectionError):  # the attack tests close the link part way through
            peer.sendall(data)

    await asyncio.to_thread(send)


@pytest.mark.asyncio
async def test_a_chained_receive_lands_every_read_exactly_when_the_peer_answers_out_of_order(pool: pump.Pool) -> None:
    """Six 8 MiB reads; a raw peer answers them in the order 0, 2, 1, 3, 5, 4. A receive job that
    chains the next reads meets a header it did not expect, ends there, and the loop takes that
    frame as any other: every block lands where it belongs and nothing else is written."""
    src = np.random.default_rng(5).integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
    order = np.random.default_rng(6).permutation(BLOCKS)
    ch, peer, local, dest, broken, seen = _reader(pool)
    try:
        async with asyncio.timeout(60):
            xfer, _ops = ch.submit(READ_REQ, _read_batch(local, dest, 9, 0, order, 2))
            requests = await _requests(peer, FRAMES)
            await _send_from_thread(peer, b"".join(_answer(src, *requests[i]) for i in (0, 2, 1, 3, 5, 4)))
            await xfer.fut
        assert _landed(dest, src, order, 2)
        assert not broken and not ch._pending
        assert any(passed for _n, passed, _m in seen), seen  # some chained header was read and passed
        assert any(mismatch for _n, _p, mismatch in seen), seen  # and some ended a job, for the loop to act on
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_chained_header_with_a_wrong_size_breaks_the_link_and_writes_nothing_after_it(pool: pump.Pool) -> None:
    """Attack: the peer answers the first read, then sends for the second a header that claims one
    block more than asked, and the bytes to fill it. The chained job stops at that header (it is
    not the one expected), the loop refuses it as a protocol error, the reads fail typed, and not
    one byte of the second read's payload, nor of anything after it, reaches our memory."""
    src = np.random.default_rng(7).integers(1, 256, BLOCKS * BLOCK, dtype=np.uint8)  # no zero byte
    order = np.arange(BLOCKS)
    ch, peer, local, dest, broken, seen = _reader(pool)
    try:
        async with asyncio.timeout(60):
            xfer, _ops = ch.submit(READ_REQ, _read_batch(local, dest, 9, 0, order, 2))
            requests = await _requests(peer, FRAMES)
            await _send_from_thread(peer, _answer(src, *requests[0]) + _answer(src, *requests[1], b"\xff" * BLOCK))
            with pytest.raises(LLMLinkFailed, match="protocol error"):
                await xfer.fut
        frame = FRAME_BLOCKS * 2 * BLOCK  # the first read's blocks, spread over twice their size
        assert _landed(dest[:frame], src[: FRAME_BLOCKS * BLOCK], order[:FRAME_BLOCKS], 2)
        assert not dest[frame:].any()  # nothing of the second read, nor after it
        assert broken
        assert any(mismatch for _n, _p, mismatch in seen), seen  # the chained job ended on that header
    finally:
        ch.close()
        peer.close()


def _push(a: TcpChannel, reg_a: Registry, reg_b: Registry, seed: int) -> tuple[Any, list[Any], np.ndarray,
                                                                               np.ndarray, np.ndarray]:
    """A writes six 8 MiB frames of scattered blocks into B's zeroed cache (block i to block 2 * order[i]):
    the transfer, its ops, A's blocks, B's memory and the order."""
    local_a, src = _cache(reg_a, BLOCKS, seed)
    cache_b, dest = _cache(reg_b, 2 * BLOCKS, None)
    order = np.random.default_rng(seed + 1).permutation(BLOCKS)
    xfer, ops = a.submit(WRITE_REQ, _read_batch(local_a, src, cache_b.cache_id, int(dest.ctypes.data), 2 * order, 1))
    return xfer, ops, src, dest, order


@pytest.mark.parametrize("bulk", ["replies to B's pull", "A's push"])
@pytest.mark.asyncio
async def test_a_joined_send_lets_a_frame_queued_behind_it_go_after_the_frame_it_is_in(pool: pump.Pool,
                                                                                      bulk: str) -> None:
    """A sends six 8 MiB frames end to end in one worker job: its replies to six reads of B's, or
    the writes of a push of its own. While that job runs, A makes a 4 KiB read of its own: the job
    is cut after the frame it is in, so A's request reaches B, and its answer comes back, before
    the bulk transfer is done (not after the whole job, which is what a job that went on to its
    end would do). For a push, B's own job serving the writes ends at the read's header. Every
    block of the bulk transfer lands where it belongs."""
    with _linked(pool) as (a, b, reg_a, reg_b, broken):
        small_a, small_dest = _cache(reg_a, 1, None)
        small_b, small_src = _cache(reg_b, 1, 12)
        done: list[str] = []
        async with asyncio.timeout(60):
            if bulk == "A's push":
                big, _ops, src, dest, order = _push(a, reg_a, reg_b, 53)
                order = np.argsort(order)  # block i went to 2 * order[i]
            else:
                cache_a, src = _cache(reg_a, BLOCKS, 11)
                local_b, dest = _cache(reg_b, 2 * BLOCKS, None)
                order = np.random.default_rng(13).permutation(BLOCKS)
                big, _ops = b.submit(READ_REQ, _read_batch(local_b, dest, cache_a.cache_id, int(src.ctypes.data),
                                                           order, 2))
            big.fut.add_done_callback(lambda _f: done.append("big"))
            await _until_joined(a)
            assert len(a._tx_outs) > 2 and a._tx_done == 0
            one = _read_batch(small_a, small_dest, small_b.cache_id, int(small_src.ctypes.data), np.array([0]), 1)
            small, _ops = a.submit(READ_REQ, one)
            small.fut.add_done_callback(lambda _f: done.append("small"))
            await small.fut
            await big.fut
        assert done == ["small", "big"]
        assert np.array_equal(small_dest, small_src)
        assert _landed(dest, src, order, 2)
        assert not broken


@pytest.mark.asyncio
async def test_a_reply_revoked_behind_a_joined_send_fails_its_read_after_one_frame(pool: pump.Pool) -> None:
    """A's worker sends sixteen 8 MiB replies to B (cache Y) as one job; a 1 MiB read of B's from A's
    cache X waits behind it. X's unregistration passes its deadline (``revoke``): that reply becomes
    an error, which cuts the job after the frame it is in, so B's read of X fails typed before B has
    all of Y (a job left to run would send the error only after the last reply of Y)."""
    from kvflow import LLMKvCacheNotExist

    blocks = FRAME_BLOCKS * 16  # long enough that the job is still going once X's reply is queued
    with _linked(pool) as (a, b, reg_a, reg_b, broken):
        cache_y, src = _cache(reg_a, blocks, 21)
        cache_x, src_x = _cache(reg_a, 256, 22)
        local_b, dest_b = _cache(reg_b, 2 * blocks, None)
        local_bx, dest_bx = _cache(reg_b, 256, None)
        done: list[str] = []
        order = np.random.default_rng(23).permutation(blocks)
        async with asyncio.timeout(60):
            big, _ops = b.submit(READ_REQ, _read_batch(local_b, dest_b, cache_y.cache_id, int(src.ctypes.data),
                                                       order, 2))
            big.fut.add_done_callback(lambda _f: done.append("y"))
            await _until_joined(a)
            one_mib = _read_batch(local_bx, dest_bx, cache_x.cache_id, int(src_x.ctypes.data), np.arange(256), 1)
            x_read, _ops = b.submit(READ_REQ, one_mib)
            x_read.fut.add_done_callback(lambda _f: done.append("x"))
            for _ in range(20000):  # until A has queued its reply from X
                if any(out.pinned is cache_x for out in a._sendq):
                    break
                await asyncio.sleep(0.0002)
            assert a._tx_job is not None and a._tx_done < len(a._tx_outs) - 1  # the joined send goes on
            assert all(out.pinned is not cache_x for out in a._tx_outs)  # and the reply from X is not in it
            a.revoke(cache_x, LLMKvCacheNotExist("cache X unregistered"))
            with pytest.raises(LLMKvCacheNotExist):
                await x_read.fut
            await big.fut
        assert done == ["x", "y"]
        assert not dest_bx.any()  # nothing of X
        assert _landed(dest_b, src, order, 2)
        assert not broken


def test_a_job_across_frames_gives_its_thread_back_at_a_frame_start_when_another_waits() -> None:
    """A send job over 64 frames of 1 MiB on a pool of one thread, and a second job submitted once
    the first has begun: the first gives the thread back at the next frame's start, and the second
    then runs to its end. Threads shared by links still take turns frame by frame, as when each
    frame was a job of its own (without that, the first job ran all 64 frames first). The first
    job may also give the thread back mid-frame, if its socket stays full for ``WAIT_S`` meanwhile
    (the rule for a waiting payload that was there before); either way its bytes are exact. The
    first job's reader starts only once the second job is submitted, so the first cannot end
    before (on a busy host it once did, and the test failed for want of its precondition)."""
    frame, frames = 1 << 20, 64
    data = np.random.default_rng(31).integers(0, 256, frame * frames, dtype=np.uint8)
    got = [bytearray(frame * frames), bytearray(frame * frames)]
    ends = [0, 0]
    pairs = [_pair(), _pair()]
    for a, _b in pairs:
        a.setblocking(False)

    go = threading.Event()  # the first job's reader waits for the second job: until then the first cannot end

    def drain(k: int) -> None:
        view, sock = memoryview(got[k]), pairs[k][1]
        if k == 0:
            go.wait(30)
        while n := sock.recv_into(view[ends[k] :]):
            ends[k] += n

    readers = [threading.Thread(target=drain, args=(k,)) for k in range(2)]
    for t in readers:
        t.start()
    base = int(data.ctypes.data)
    starts = np.arange(frames, dtype=np.uint64) * np.uint64(frame)
    table = IovCursor(np.uint64(base) + starts, np.full(frames, frame, np.uint64), CHUNK_BYTES, few_searches=True)
    first = pump.Job(table, frame * frames, starts[1:].astype(np.int64))
    second = pump.Job(IovCursor(np.array([base], np.uint64), np.array([frame], np.uint64), CHUNK_BYTES), frame)
    executor = ThreadPoolExecutor(1)
    pool = pump.Pool(executor, True)
    try:
        fut1 = pool.send(pairs[0][0], first)
        deadline = time.monotonic() + 10
        while first.moved() <= 0 and time.monotonic() < deadline:
            time.sleep(0.0001)
        fut2 = pool.send(pairs[1][0], second)
        go.set()
        fut1.result(timeout=30)
        fut2.result(timeout=30)
        sent = frame * frames - first.left
        assert 0 < sent < frame * frames, sent
        assert second.left == 0
    finally:
        go.set()
        executor.shutdown(wait=True)
        for a, _b in pairs:
            a.close()
        for t in readers:
            t.join(timeout=10)
        for _a, b in pairs:
            b.close()
    assert ends == [sent, frame]
    assert got[0][:sent] == data[:sent].tobytes() and got[1][:frame] == data[:frame].tobytes()


# ------------------------------------------------------------- the peer's writes, served in one job
WRITE_FRAMES = 6


def _write_frame(req_id: int, cache_id: int, addrs: list[int], payload: bytes, lens: list[int] | None = None,
                 total: int | None = None) -> bytes:
    """A write request as a peer sends it: header, run table, payload (``lens`` and ``total`` as
    claimed, by default the true ones)."""
    lens = lens if lens is not None else [BLOCK] * len(addrs)
    table = struct.pack(f"<{2 * len(addrs)}Q", *(v for pair in zip(addrs, lens) for v in pair))
    claimed = len(payload) if total is None else total
    return HDR.pack(WRITE_REQ, 0, 0, len(addrs), req_id, cache_id, claimed) + table + payload


async def _write_answers(peer: socket.socket, count: int) -> dict[int, int]:
    """Read ``count`` write answers off the raw peer socket: status by request id."""
    loop = asyncio.get_running_loop()
    peer.setblocking(False)
    buf = bytearray()
    while len(buf) < count * HDR.size:
        buf += await loop.sock_recv(peer, 1 << 16)
    answers = {}
    for k in range(count):
        kind, _f, _r, _n, req_id, status, total = HDR.unpack_from(buf, k * HDR.size)
        assert kind == WRITE_RSP and total == 0
        answers[req_id] = status
    return answers


def _watch_serves(ch: TcpChannel) -> list[int]:
    """For each serve job the channel settles, the bytes it read past its first write's payload."""
    seen: list[int] = []
    settle = ch._settle_serve

    def watched(job: pump.Job) -> None:
        seen.append(job.moved() - job._total)
        settle(job)

    ch._settle_serve = watched  # type: ignore[method-assign]
    return seen


def _server(pool: pump.Pool, blocks: int, guard: int = 0) -> tuple[TcpChannel, socket.socket, Registry, LocalCache,
                                                                   np.ndarray, list[BaseException], list[int]]:
    """Our channel serving a raw peer, and a zeroed cache of ``blocks`` blocks registered on the
    start of a buffer ``guard`` blocks longer (memory the peer must never reach): the channel, the
    peer, the registry, the cache, the whole buffer, the broken-link list and the serves seen."""
    ours, peer = _pair()
    reg = Registry()
    mem = np.zeros((blocks + guard) * BLOCK, np.uint8)
    local = reg.add(CacheDesc(1, DataType.DT_UINT8, [blocks, BLOCK]), [mem[: blocks * BLOCK]])
    broken: list[BaseException] = []
    ch = _channel(ours, reg, pool, broken)
    return ch, peer, reg, local, mem, broken, _watch_serves(ch)


@pytest.mark.asyncio
async def test_writes_served_in_one_job_land_exactly_and_each_is_answered(pool: pump.Pool) -> None:
    """Six 8 MiB writes of scattered blocks from a raw peer, sent end to end: one receive job takes
    several of them after the first without the loop checking each (the C loop checks their
    headers and runs), every block lands where its run says, nothing else is written, and every
    write gets its own success answer."""
    src = np.random.default_rng(41).integers(1, 256, BLOCKS * BLOCK, dtype=np.uint8)
    order = np.random.default_rng(42).permutation(BLOCKS)
    ch, peer, _reg, local, mem, broken, seen = _server(pool, 2 * BLOCKS)
    base = int(mem.ctypes.data)
    frames = []
    for f in range(WRITE_FRAMES):
        idx = order[f * FRAME_BLOCKS : (f + 1) * FRAME_BLOCKS]
        addrs = [base + 2 * int(i) * BLOCK for i in idx]
        blocks = src[f * FRAME_BLOCKS * BLOCK : (f + 1) * FRAME_BLOCKS * BLOCK].tobytes()
        frames.append(_write_frame(100 + f, local.cache_id, addrs, blocks))  # block k goes to 2 * order[k]
    try:
        async with asyncio.timeout(60):
            await _send_from_thread(peer, b"".join(frames))
            answers = await _write_answers(peer, WRITE_FRAMES)
        assert answers == {100 + f: 0 for f in range(WRITE_FRAMES)}
        assert _landed(mem, src, np.argsort(order), 2)
        assert not broken
        frame_bytes = HDR.size + FRAME_BLOCKS * (RUN.itemsize + BLOCK)
        assert any(rest >= frame_bytes for rest in seen), seen  # a job went on through a whole write
    finally:
        ch.close()
        peer.close()


@pytest.mark.parametrize("attack", ["a run past the cache's end", "the header names another cache",
                                    "runs longer than the payload", "runs shorter than the payload",
                                    "a cache being unregistered"])
@pytest.mark.asyncio
async def test_a_served_write_the_loop_would_refuse_is_refused_and_writes_nothing(pool: pump.Pool,
                                                                                  attack: str) -> None:
    """Attack: a good 8 MiB write, then one the loop's checks refuse, then a good one, end to end.
    The job serving the first reads the second's header and run table, finds them outside what it
    may take alone, and ends there; the loop refuses that write typed and discards its payload
    (whatever it claims, nothing of it lands, in the cache or in the memory just past it), and the
    third write lands as usual."""
    from kvflow import LLMKvCacheNotExist, LLMParamInvalid

    blocks = 3 * FRAME_BLOCKS
    ch, peer, reg, local, mem, broken, seen = _server(pool, blocks, guard=4)
    other, _other_mem = _cache(reg, 4, None)
    base = int(mem.ctypes.data)
    src = np.random.default_rng(43).integers(1, 256, 3 * FRAME_BLOCKS * BLOCK, dtype=np.uint8).reshape(-1, BLOCK)
    first = [base + i * BLOCK for i in range(FRAME_BLOCKS)]
    second = [base + (FRAME_BLOCKS + i) * BLOCK for i in range(FRAME_BLOCKS)]
    third = [base + (2 * FRAME_BLOCKS + i) * BLOCK for i in range(FRAME_BLOCKS)]
    payload2 = src[FRAME_BLOCKS : 2 * FRAME_BLOCKS].tobytes()
    cache2, lens2, total2, code = local.cache_id, None, None, int(LLMParamInvalid("").status_code)
    if attack == "a run past the cache's end":
        second[-1] = base + blocks * BLOCK - BLOCK // 2  # half of it in the memory after the cache
    elif attack == "the header names another cache":
        cache2 = other.cache_id  # registered, but the runs are in ours
    elif attack == "runs longer than the payload":
        lens2 = [BLOCK] * (FRAME_BLOCKS - 1) + [2 * BLOCK]  # the header's total is one block short of these
        total2 = len(payload2)
    elif attack == "runs shorter than the payload":
        payload2 += bytes(range(1, 256)) * 16 + b"\x01" * 16  # a block more than the runs hold
    frames = _write_frame(1, local.cache_id, first, src[:FRAME_BLOCKS].tobytes())
    bad = _write_frame(2, cache2, second, payload2, lens2, total2)
    last = _write_frame(3, local.cache_id, third, src[2 * FRAME_BLOCKS :].tobytes())
    try:
        async with asyncio.timeout(60):
            if attack == "a cache being unregistered":
                code = int(LLMKvCacheNotExist("").status_code)
                await _send_from_thread(peer, frames[: len(frames) // 2])
                for _ in range(20000):  # until a worker lands the first write
                    if ch._rx_job is not None and ch._rx_job.moved() > 0:
                        break
                    await asyncio.sleep(0.0002)
                assert ch._rx_job is not None
                local.closing = True  # unregister_kv_cache began: new writes on the cache are refused
                await _send_from_thread(peer, frames[len(frames) // 2 :] + bad)
                answers = await _write_answers(peer, 2)
                assert answers == {1: 0, 2: code}
            else:
                await _send_from_thread(peer, frames + bad + last)
                answers = await _write_answers(peer, 3)
                assert answers == {1: 0, 2: code, 3: 0}, attack
        view = mem.reshape(-1, BLOCK)
        assert np.array_equal(view[:FRAME_BLOCKS], src[:FRAME_BLOCKS])
        assert not view[FRAME_BLOCKS : 2 * FRAME_BLOCKS].any()  # nothing of the refused write
        assert not view[blocks:].any()  # nor past the cache
        if attack != "a cache being unregistered":
            assert np.array_equal(view[2 * FRAME_BLOCKS : blocks], src[2 * FRAME_BLOCKS :])
        assert not broken
        at_header = attack in ("the header names another cache", "a cache being unregistered")
        assert (HDR.size if at_header else HDR.size + FRAME_BLOCKS * RUN.itemsize) in seen, seen  # where it ended
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_cache_revoked_while_a_job_serves_a_write_into_it_gets_no_byte_after(pool: pump.Pool) -> None:
    """A job lands a peer's first write and goes on into the second; half of the second's payload is
    in when the cache's unregistration passes its deadline (``revoke``). The job is stopped there:
    the first write is answered with success, the second with the cache's error, and not one byte
    of the second's other half, nor of a third write, reaches the cache."""
    from kvflow import LLMKvCacheNotExist

    blocks = 3 * FRAME_BLOCKS
    ch, peer, _reg, local, mem, broken, seen = _server(pool, blocks)
    base = int(mem.ctypes.data)
    src = np.random.default_rng(44).integers(1, 256, blocks * BLOCK, dtype=np.uint8).reshape(-1, BLOCK)
    frames = [_write_frame(1 + f, local.cache_id, [base + (f * FRAME_BLOCKS + i) * BLOCK for i in range(FRAME_BLOCKS)],
                           src[f * FRAME_BLOCKS : (f + 1) * FRAME_BLOCKS].tobytes()) for f in range(3)]
    half = len(frames[0]) + HDR.size + FRAME_BLOCKS * (RUN.itemsize + BLOCK // 2)  # into the second payload
    stream = b"".join(frames)
    gone = LLMKvCacheNotExist("cache unregistered")
    try:
        async with asyncio.timeout(60):
            await _send_from_thread(peer, stream[:half])
            into = half - len(frames[0])  # the bytes the serve job reads past the first payload
            for _ in range(20000):
                job = ch._rx_job
                if job is not None and job.serve is not None and job.moved() - job._total == into:
                    break
                await asyncio.sleep(0.0002)
            assert job is not None and job.serve is not None, "no job went on into the second write"
            assert job.moved() - job._total == into, "the job did not reach the second payload"
            local.closing = True
            ch.revoke(local, gone)
            landed = mem.copy()
            await _send_from_thread(peer, stream[half:])
            answers = await _write_answers(peer, 3)
        code = int(gone.status_code)
        assert answers == {1: 0, 2: code, 3: code}
        view = mem.reshape(-1, BLOCK)
        assert np.array_equal(view[:FRAME_BLOCKS], src[:FRAME_BLOCKS])
        assert np.array_equal(mem, landed)  # nothing after the revoke
        half_bytes = FRAME_BLOCKS * BLOCK // 2
        second = mem[FRAME_BLOCKS * BLOCK : 2 * FRAME_BLOCKS * BLOCK]
        assert np.array_equal(second[:half_bytes], src[FRAME_BLOCKS:].reshape(-1)[:half_bytes])
        assert not second[half_bytes:].any() and not view[2 * FRAME_BLOCKS :].any()
        assert not broken and seen
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_push_given_up_during_a_joined_send_sends_none_of_the_frames_not_begun(pool: pump.Pool) -> None:
    """A's worker sends six 8 MiB writes to B as one job, and the caller gives the push up while the
    job is in its first frames: the job is stopped, the frame it is in goes out whole (the stream
    must stay in step), and none of the frames it had not begun reaches B."""
    with _linked(pool) as (a, b, reg_a, reg_b, broken):
        async with asyncio.timeout(60):
            push, ops, _src, dest, order = _push(a, reg_a, reg_b, 54)
            push.fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            settles: list[tuple[int, list[int]]] = []
            settle = a._settle_tx

            def watched(job: pump.Job) -> None:
                settles.append((job.moved(), list(a._tx_ends)))  # where the stopped job was, and frame ends
                settle(job)

            a._settle_tx = watched  # type: ignore[method-assign]
            await _until_joined(a)
            a.abandon(ops)
            assert settles, "the joined send was not stopped"
            moved, ends = settles[0]
            begun = 1 + sum(1 for end in ends[:-1] if end < moved)  # frames with a byte sent
            assert begun < FRAMES, "the joined send had begun every frame before the push was given up"
            for _ in range(20000):  # until both sides are idle: the begun frames sent, landed and answered
                if a._tx_job is None and not a._sendq and not a._pending and b._rx_job is None \
                        and b._state == _ST_HDR and not b._sendq:
                    break
                await asyncio.sleep(0.0005)
            assert not a._pending
        view = dest.reshape(-1, BLOCK)[::2]
        landed = [bool(view[order[f * FRAME_BLOCKS : (f + 1) * FRAME_BLOCKS]].any()) for f in range(FRAMES)]
        assert landed == [f < begun for f in range(FRAMES)], (landed, begun)
        assert not broken


@pytest.mark.asyncio
async def test_joined_sends_one_after_another_reuse_the_table_memory_and_land_exactly(pool: pump.Pool) -> None:
    """A pushes twice, each push six frames that its worker sends as one job. The second job builds
    its table in the memory the first one used (``TcpChannel._tx_table_arena``), and every block of
    both pushes lands where it belongs, so no table outlived its job."""
    with _linked(pool) as (a, _b, reg_a, reg_b, broken):
        arenas = []
        async with asyncio.timeout(60):
            for seed in (61, 71):
                xfer, _ops, src, dest, order = _push(a, reg_a, reg_b, seed)
                await _until_joined(a)
                assert len(a._tx_outs) > 2, "the push's frames did not go out in one job"
                assert a._tx_arena.size >= 5 * FRAME_BLOCKS * 2, "the joined send's table is not in the kept memory"
                arenas.append(a._tx_arena.ctypes.data)
                await xfer.fut
                assert _landed(dest, src, np.argsort(order), 2)
        assert arenas[0] == arenas[1], "the second joined send did not reuse the first one's table memory"
        assert not broken
