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
from kvflow._tcp import CHUNK_BYTES, HDR, READ_REQ, READ_RSP, RUN, TcpChannel
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


@pytest.mark.asyncio
async def test_a_joined_send_lets_a_frame_queued_behind_it_go_after_the_frame_it_is_in(pool: pump.Pool) -> None:
    """A serves six 8 MiB reads of B's, sent end to end by one worker job. While that job runs, A
    makes a 4 KiB read of its own: the job is cut after the frame it is in, so A's request reaches
    B, and its answer comes back, before B has received all it asked for (not after the whole job,
    which is what a job that went on to its end would do)."""
    with _linked(pool) as (a, b, reg_a, reg_b, broken):
        cache_a, src = _cache(reg_a, BLOCKS, 11)
        small_a, small_dest = _cache(reg_a, 1, None)
        local_b, dest_b = _cache(reg_b, 2 * BLOCKS, None)
        small_b, small_src = _cache(reg_b, 1, 12)
        order = np.random.default_rng(13).permutation(BLOCKS)
        done: list[str] = []
        async with asyncio.timeout(60):
            pull = _read_batch(local_b, dest_b, cache_a.cache_id, int(src.ctypes.data), order, 2)
            big, _ops = b.submit(READ_REQ, pull)
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
        assert _landed(dest_b, src, order, 2)
        assert not broken


@pytest.mark.asyncio
async def test_a_reply_revoked_behind_a_joined_send_fails_its_read_after_one_frame(pool: pump.Pool) -> None:
    """A's worker sends six 8 MiB replies to B (cache Y) as one job; a 1 MiB read of B's from A's
    cache X waits behind it. X's unregistration passes its deadline (``revoke``): that reply becomes
    an error, which cuts the job after the frame it is in, so B's read of X fails typed before B has
    all of Y (a job left to run would send the error only after the last reply of Y)."""
    from kvflow import LLMKvCacheNotExist

    with _linked(pool) as (a, b, reg_a, reg_b, broken):
        cache_y, src = _cache(reg_a, BLOCKS, 21)
        cache_x, src_x = _cache(reg_a, 256, 22)
        local_b, dest_b = _cache(reg_b, 2 * BLOCKS, None)
        local_bx, dest_bx = _cache(reg_b, 256, None)
        done: list[str] = []
        order = np.random.default_rng(23).permutation(BLOCKS)
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
    (the rule for a waiting payload that was there before); either way its bytes are exact."""
    frame, frames = 1 << 20, 64
    data = np.random.default_rng(31).integers(0, 256, frame * frames, dtype=np.uint8)
    got = [bytearray(frame * frames), bytearray(frame * frames)]
    ends = [0, 0]
    pairs = [_pair(), _pair()]
    for a, _b in pairs:
        a.setblocking(False)

    def drain(k: int) -> None:
        view, sock = memoryview(got[k]), pairs[k][1]
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
        fut1.result(timeout=30)
        fut2.result(timeout=30)
        sent = frame * frames - first.left
        assert 0 < sent < frame * frames, sent
        assert second.left == 0
    finally:
        executor.shutdown(wait=True)
        for a, _b in pairs:
            a.close()
        for t in readers:
            t.join(timeout=10)
        for _a, b in pairs:
            b.close()
    assert ends == [sent, frame]
    assert got[0][:sent] == data[:sent].tobytes() and got[1][:frame] == data[:frame].tobytes()
