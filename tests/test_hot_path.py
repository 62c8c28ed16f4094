"""The small-transfer fast path: run tables, the cheap deadline, busy polling on TCP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, LLMParamInvalid, LlmRole
from kvflow._deadline import Deadline
from kvflow._memory import LocalCache, Registry
from kvflow.testing import inspect
from kvflow.transport import Endpoint, RemoteCache, RunBatch, Started

from .conftest import LOCAL_CLUSTER, PEER_CLUSTER, Peer, start_peer


# ---------------------------------------------------------------------- Deadline
@pytest.mark.asyncio
async def test_deadline_fires_and_is_told_apart_from_other_cancels() -> None:
    async def wait(delay: float, outer_cancel: bool) -> str:
        d = Deadline(delay)
        try:
            if outer_cancel:
                asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(1)
            return "finished"
        except asyncio.CancelledError:
            if d.stop():
                return "timed out"
            raise
        finally:
            d.stop()

    t0 = time.monotonic()
    assert await wait(0.02, False) == "timed out"
    assert time.monotonic() - t0 < 0.5
    task = asyncio.ensure_future(wait(5, True))  # somebody else's cancel stays a cancel
    with pytest.raises(asyncio.CancelledError):
        await task
    # our timeout withdraws only its own request: the task is not left marked as cancelling
    inner = asyncio.ensure_future(wait(0.01, False))
    assert await inner == "timed out" and inner.cancelling() == 0


@pytest.mark.asyncio
async def test_deadline_stopped_in_time_never_fires() -> None:
    d = Deadline(0.01)
    assert d.stop() is False
    await asyncio.sleep(0.05)  # would have fired by now
    assert d.expired is False and d.stop() is False


# ---------------------------------------------------------------------- RunBatch
def _caches() -> tuple[LocalCache, RemoteCache]:
    desc = CacheDesc(2, DataType.DT_UINT8, [4, 16])
    local = Registry().add(desc, [np.zeros(64, np.uint8), np.zeros(64, np.uint8)])
    return local, RemoteCache(1, 7, desc, ())


def test_run_batch_is_one_table_with_row_views() -> None:
    local, remote = _caches()
    la = np.array([10, 20, 30], dtype=np.uint64)
    ra = la + np.uint64(1000)
    lens = np.array([1, 2, 3], dtype=np.uint64)
    lt = np.array([0, 1, 0], dtype=np.int64)
    rt = np.array([1, 1, 0], dtype=np.int64)
    b = RunBatch(la, ra, lens, lt, rt, local, remote)
    assert b.table.shape == (5, 3) and b.table.dtype == np.uint64 and b.table.flags.c_contiguous
    assert RunBatch.ROWS == ("local_addrs", "remote_addrs", "lengths", "local_tensor", "remote_tensor")
    for name, want in zip(RunBatch.ROWS, (la, ra, lens, lt, rt)):
        got = getattr(b, name)
        assert got.tolist() == want.tolist() and got.dtype == want.dtype
    assert len(b) == 3 and b.nbytes == 6
    part = b[1:]
    assert part.local_addrs.tolist() == [20, 30] and part.table.flags.c_contiguous
    assert part.local_cache is local and part.remote_cache is remote
    same = RunBatch.of_table(b.table, local, remote)
    assert same.table is b.table
    big = RunBatch.of_table(np.ones((5, 100), dtype=np.uint64), local, remote)
    assert big.nbytes == 100  # the numpy sum path (more than 64 runs)


def test_endpoint_fast_path_is_optional() -> None:
    class Slow(Endpoint):
        async def read(self, batch: RunBatch) -> None: ...
        async def write(self, batch: RunBatch) -> None: ...

    local, remote = _caches()
    b = RunBatch.of_table(np.zeros((5, 1), dtype=np.uint64), local, remote)
    assert Slow().read_now(b) is False and Slow().write_now(b) is False


def test_small_views_check_every_run() -> None:
    local, _ = _caches()
    base = local.regions[1].addr
    views = local.views_small([base + 4], [8])
    assert len(views) == 1 and len(views[0]) == 8
    for addr, n in [(base + 60, 8), (base - 1, 1), (base, 0), (base + 64, 1)]:
        with pytest.raises(LLMParamInvalid):
            local.views_small([addr], [n])


# ---------------------------------------------------------------------- TCP busy polling
@pytest_asyncio.fixture
async def tcp_peer() -> AsyncIterator[Peer]:
    peer = start_peer("tcp")
    try:
        yield peer
    finally:
        peer.proc.stop()


async def _linked(peer: Peer, **options: str) -> LlmDataDist:
    dd = LlmDataDist(LOCAL_CLUSTER, LlmRole.DECODER)
    await dd.initialize({**peer.options, **options})
    assert await dd.link_llm_clusters([ClusterInfo(PEER_CLUSTER, [IpInfo(*peer.address)])], 5000) == [0]
    return dd


def _channel(dd: LlmDataDist) -> Any:
    return inspect.links(dd)[PEER_CLUSTER].endpoint._ch  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_tcp_integer_options_are_checked() -> None:
    for key, bad in (("BusyPollUs", "x"), ("BusyPollUs", "-1"), ("BusyPollUs", "100001"), ("InlinePollUs", "-1"),
                     ("InlinePollUs", "100001"), ("ThreadBytes", "-1"),
                     ("ThreadBytes", "1.5"), ("Threads", "0"), ("Threads", "65")):
        dd = LlmDataDist(3, LlmRole.DECODER)
        with pytest.raises(LLMParamInvalid, match=rf"kvflow\.tcp\.{key}"):
            await dd.initialize({"kvflow.Transports": "tcp", f"kvflow.tcp.{key}": bad})


@pytest.mark.asyncio
@pytest.mark.parametrize("poll_us", ["50", "0"])
async def test_busy_poll_is_bounded_and_can_be_off(tcp_peer: Peer, poll_us: str) -> None:
    """Small transfers make the channel poll for the next frame; it stops by itself once traffic
    stops (no CPU burnt while idle), and BusyPollUs=0 never polls."""
    desc = CacheDesc(1, DataType.DT_UINT8, [16, 4096])
    rid = await tcp_peer.register(desc, seed=5)
    want = (await tcp_peer.read(rid))[0].reshape(16, 4096)
    # InlinePollUs=0: every reply is waited for on the loop, so that the loop's polling is what runs
    dd = await _linked(tcp_peer, **{"kvflow.tcp.BusyPollUs": poll_us, "kvflow.tcp.InlinePollUs": "0"})
    try:
        buf = np.zeros(16 * 4096, np.uint8)
        cache = await dd.register_kv_cache(desc, [buf])
        ch = _channel(dd)
        polls = 0
        poll = ch._poll

        def counted() -> None:  # counts the polling callbacks (sampling _polling after a pull races its end)
            nonlocal polls
            polls += 1
            poll()

        ch._poll = counted
        for i in range(50):
            await dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [i % 16], [(i * 3) % 16])
        assert np.array_equal(buf.reshape(16, 4096)[(49 * 3) % 16], want[49 % 16])
        assert (polls > 0) is (poll_us != "0"), polls
        cpu0 = time.process_time()
        await asyncio.sleep(0.3)
        assert not ch._polling
        assert time.process_time() - cpu0 < 0.1  # idle: the loop sleeps again
    finally:
        await dd.finalize()


async def _inline_results(peer: Peer, options: dict[str, str], push: bool, method: str = "now_rows") -> list[Any]:
    """50 one-block pulls (or pushes) over tcp with ``options``: what ``TcpChannel.<method>`` returned
    for each (checking every block's bytes on the way). tcp's ``blocks_now`` calls ``now_rows``; the
    core's ``read_now`` / ``write_now`` path, taken when ``blocks_now`` declines, calls ``now``."""
    desc = CacheDesc(1, DataType.DT_UINT8, [16, 4096])
    rid = await peer.register(desc, seed=7)
    want = (await peer.read(rid))[0].reshape(16, 4096)
    dd = await _linked(peer, **options)
    try:
        buf = np.random.default_rng(3).integers(0, 256, 16 * 4096, dtype=np.uint8)
        cache = await dd.register_kv_cache(desc, [buf])
        ci = CacheIndex(PEER_CLUSTER, rid)
        await dd.pull_kv_blocks(ci, cache, [0], [0])  # learns the peer's cache
        ch = _channel(dd)
        results: list[Any] = []
        now = getattr(ch, method)

        def recorded(*args: Any) -> Any:
            results.append(now(*args))
            return results[-1]

        setattr(ch, method, recorded)
        for i in range(50):
            if push:
                await dd.push_kv_blocks(cache, ci, [i % 16], [(i * 3) % 16])
                got = (await peer.read(rid))[0].reshape(16, 4096)[(i * 3) % 16]
                assert np.array_equal(got, buf.reshape(16, 4096)[i % 16]), i
            else:
                await dd.pull_kv_blocks(ci, cache, [i % 16], [(i * 3) % 16])
                assert np.array_equal(buf.reshape(16, 4096)[(i * 3) % 16], want[i % 16]), i
        ops = dd.stats()["ops"]  # every transfer counted, whichever way it finished
        assert ops["push" if push else "pull"]["bytes"] == 4096 * (50 if push else 51), ops
        return results
    finally:
        await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
async def test_tcp_small_transfer_is_answered_inside_the_call(tcp_peer: Peer, push: bool) -> None:
    """With a poll window of a millisecond, small transfers read their reply inside the caller's call
    (``now`` returns bytes and runs; no future, no loop turn): at least one of 50 does on a busy host."""
    results = await _inline_results(tcp_peer, {"kvflow.tcp.BusyPollUs": "1000", "kvflow.tcp.InlinePollUs": "1000"},
                                    push)
    assert len(results) == 50 and any(r == (4096, 1) for r in results), results


@pytest.mark.asyncio
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
async def test_tcp_small_transfer_whose_reply_is_late_finishes_on_the_loop(tcp_peer: Peer, push: bool) -> None:
    """A 1 µs inline window: the reply comes later, ``now`` hands the transfer back begun
    (``Started``), and the core awaits it under the deadline; every block's bytes are exact."""
    results = await _inline_results(tcp_peer, {"kvflow.tcp.InlinePollUs": "1"}, push)
    assert len(results) == 50 and any(isinstance(r, Started) for r in results), results


@pytest.mark.asyncio
async def test_tcp_inline_reads_are_off_without_a_poll_budget(tcp_peer: Peer) -> None:
    """BusyPollUs=0 bounds the inline window too: nothing polls, ``blocks_now`` declines, and so does
    ``now`` on the core's path, every time."""
    results = await _inline_results(tcp_peer, {"kvflow.tcp.BusyPollUs": "0"}, False, "now")
    assert results == [None] * 50


@pytest.mark.asyncio
async def test_serving_side_polls_only_while_requests_come_close_together() -> None:
    """The side that serves small requests polls for the next one only while they arrive within a
    poll window of each other: a trickle of requests costs no polling CPU on the serving side."""
    srv, cli = LlmDataDist(1, LlmRole.PROMPT), LlmDataDist(2, LlmRole.DECODER)
    opts = {"kvflow.Transports": "tcp", "kvflow.tcp.BusyPollUs": "1000"}
    await srv.initialize({**opts, "llm.ListenIpInfo": "127.0.0.1:0"})
    await cli.initialize(opts)
    try:
        desc = CacheDesc(1, DataType.DT_UINT8, [16, 4096])
        src = np.arange(16 * 4096, dtype=np.uint32).astype(np.uint8)
        remote = await srv.register_kv_cache(desc, [src])
        dst = np.zeros(16 * 4096, np.uint8)
        cache = await cli.register_kv_cache(desc, [dst])
        assert srv.listen_address is not None
        assert await cli.link_llm_clusters([ClusterInfo(1, [IpInfo(*srv.listen_address)])], 5000) == [0]
        ci = CacheIndex(1, remote.cache_id)
        await cli.pull_kv_blocks(ci, cache, [0], [0])  # the link's first pull learns the peer's cache
        ch = inspect.links(srv)[2].endpoint._ch  # type: ignore[union-attr]
        polls = 0
        poll = ch._poll

        def counted() -> None:
            nonlocal polls
            polls += 1
            poll()

        ch._poll = counted
        for i in range(30):  # back to back: each request comes well within 1 ms of the last
            await cli.pull_kv_blocks(ci, cache, [i % 16], [i % 16])
        close_together = polls
        while ch._polling:
            await asyncio.sleep(0.001)
        polls = 0
        for i in range(10):  # 20 ms apart: polling between them would be wasted
            await asyncio.sleep(0.02)
            await cli.pull_kv_blocks(ci, cache, [i], [15 - i])
        assert close_together > 0 and polls == 0, (close_together, polls)
        assert np.array_equal(dst.reshape(16, 4096)[15 - 9], src.reshape(16, 4096)[9])
    finally:
        await cli.finalize()
        await srv.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("iov_path", [True, False])
async def test_large_frames_with_and_without_the_iovec_path(tcp_peer: Peer, iov_path: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of many runs go through kvflow._iov (readv/sendmsg from the run table); where libc
    is not loadable the channel keeps to memoryviews. Both move the same bytes (this side only:
    the peer process keeps its default)."""
    import kvflow._iov as iov

    monkeypatch.setattr(iov, "AVAILABLE", iov_path and iov.AVAILABLE)
    calls = {"recv": 0, "send": 0}
    for name in calls:
        def counted(self: Any, sock: Any, _name: str = name, _orig: Any = getattr(iov.IovCursor, name)) -> Any:
            calls[_name] += 1
            return _orig(self, sock)
        monkeypatch.setattr(iov.IovCursor, name, counted)
    desc = CacheDesc(2, DataType.DT_UINT8, [64, 1024])
    rid = await tcp_peer.register(desc, seed=11)
    want = [a.reshape(64, 1024) for a in await tcp_peer.read(rid)]
    dd = await _linked(tcp_peer)
    try:
        bufs = [np.zeros(64 * 1024, np.uint8) for _ in range(2)]
        cache = await dd.register_kv_cache(desc, bufs)
        src = list(range(0, 64, 2))  # 32 blocks x 2 tensors, nothing coalesces: 64 runs per frame
        dst = [63 - b for b in src]
        await dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, src, dst)
        for t in range(2):
            got = bufs[t].reshape(64, 1024)
            assert all(np.array_equal(got[d], want[t][s]) for s, d in zip(src, dst))
        for t in range(2):
            bufs[t][:] = 200 + t
        await dd.push_kv_blocks(cache, CacheIndex(PEER_CLUSTER, rid), dst, src)
        after = [a.reshape(64, 1024) for a in await tcp_peer.read(rid)]
        for t in range(2):
            assert all((after[t][s] == 200 + t).all() for s in src)
            assert all(np.array_equal(after[t][b], want[t][b]) for b in range(1, 64, 2))  # others untouched
        assert (calls["recv"] > 0 and calls["send"] > 0) is iov_path, calls
    finally:
        await dd.finalize()


# ---------------------------------------------------------------------- a small reply in pieces
def _raw_peer(desc: CacheDesc, arr: np.ndarray,
              inline_poll: float = 0.0) -> tuple[LocalCache, Any, Any, Any, list[BaseException]]:
    """``arr`` registered as ``desc``; a TcpChannel on our end of a loopback connection (reading a
    small reply inside ``now_rows`` for up to ``inline_poll`` s) and a raw non-blocking socket at the
    peer's (the loop's sock_recv would block on a blocking one). Returns the cache, our socket, the
    peer's, the channel and the list its broken-link callback fills."""
    import socket

    from kvflow._tcp import TcpChannel

    reg = Registry()
    local = reg.add(desc, [arr])
    lsock = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(lsock.getsockname())
    ours, _ = lsock.accept()
    lsock.close()
    peer.setblocking(False)
    broken: list[BaseException] = []
    return local, ours, peer, TcpChannel(ours, reg, broken.append, inline_poll, None, inline_poll=inline_poll), broken


def _kernel_takes(ch: Any, ours: Any, taken: int | None) -> list[int]:
    """Unless ``taken`` is None, the channel's direct ``sendmsg`` of an answer really sends only its
    first ``taken`` bytes, as a full send buffer would; returns the list of what each offer sent."""
    offers: list[int] = []
    if taken is not None:
        def offer(bufs: list[Any]) -> int:
            offers.append(ours.send(b"".join(bufs)[:taken]) if taken else 0)
            return offers[-1]

        ch._offer = offer
    return offers


@pytest.mark.asyncio
@pytest.mark.parametrize("first", [0, 1000, 4095], ids=["header-alone", "header-and-1000", "all-but-one-byte"])
async def test_a_small_reply_that_arrives_in_pieces_lands_whole(first: int) -> None:
    """The reader takes a small reply's payload straight after its header in one ``recvmsg_into``.
    A raw peer sends the header with ``first`` payload bytes, then the rest 50 ms later: the read
    carries on from where that call stopped, and the block holds exactly the peer's bytes."""
    import struct

    from kvflow._tcp import HDR, READ_REQ, READ_RSP

    arr = np.zeros(16 * 4096, dtype=np.uint8)
    local, _ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [16, 4096]), arr)
    try:
        async with asyncio.timeout(10):
            base = int(arr.ctypes.data)
            moved = ch.now_rows(READ_REQ, [[base + 3 * 4096], [0x5000], [4096], [0], [0]], local, 9)
            assert isinstance(moved, Started)  # no inline window: the reply is read on the loop
            request = await asyncio.get_running_loop().sock_recv(peer, HDR.size + 16)
            kind, _f, _r, count, req_id, cache_id, total = HDR.unpack(request[: HDR.size])
            assert (kind, count, cache_id, total) == (READ_REQ, 1, 9, 4096)
            assert struct.unpack("<2Q", request[HDR.size :]) == (0x5000, 4096)
            payload = np.random.default_rng(first).integers(0, 256, 4096, dtype=np.uint8).tobytes()
            peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096) + payload[:first])
            await asyncio.sleep(0.05)
            assert arr[3 * 4096 : 3 * 4096 + first].tobytes() == payload[:first]  # the first part landed
            peer.sendall(payload[first:])
            await moved.done
        assert arr[3 * 4096 : 4 * 4096].tobytes() == payload
        assert not arr[: 3 * 4096].any() and not arr[4 * 4096 :].any()
        assert not broken and not ch._pending and not ch._sendq  # nothing left in flight
        assert ch._state == 0 and ch._got == 0  # the reader waits for the next frame's header
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_peer_that_closes_after_a_small_reply_header_fails_the_read() -> None:
    """The header of a small reply, then the peer closes: the read fails as a broken link (the reply's
    read had already taken it off the pending requests; it hung until the teardown was told of it)."""

    from kvflow import LLMLinkFailed
    from kvflow._tcp import HDR, READ_REQ, READ_RSP

    arr = np.zeros(4096, dtype=np.uint8)
    local, _ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [1, 4096]), arr)
    try:
        async with asyncio.timeout(10):
            moved = ch.now_rows(READ_REQ, [[int(arr.ctypes.data)], [0x5000], [4096], [0], [0]], local, 9)
            assert isinstance(moved, Started)
            request = await asyncio.get_running_loop().sock_recv(peer, HDR.size + 16)
            req_id = HDR.unpack(request[: HDR.size])[4]
            peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096))
            peer.close()
            with pytest.raises(LLMLinkFailed, match="closed"):
                await moved.done
        assert broken
    finally:
        ch.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("taken", [None, 0, 1000], ids=["whole", "none", "part"])
async def test_a_small_reply_is_offered_whole_and_the_queue_sends_what_the_offer_left(taken: int | None) -> None:
    """A peer's small read is answered with one ``sendmsg`` ahead of the queue; what that call did not
    take goes out from the queue, once, in order. ``taken`` stands in for the kernel taking none or
    1000 bytes of the reply (a full or nearly full send buffer, which cannot be arranged to the byte):
    those bytes are really sent, the rest is the queue's. The cache is unpinned afterwards."""
    import struct

    from kvflow._tcp import HDR, READ_REQ, READ_RSP

    arr = np.random.default_rng(5).integers(0, 256, 16 * 4096, dtype=np.uint8)
    local, ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [16, 4096]), arr)
    offers = _kernel_takes(ch, ours, taken)
    try:
        async with asyncio.timeout(10):
            base = int(arr.ctypes.data)
            runs = struct.pack("<2Q", base + 5 * 4096, 4096)
            peer.sendall(HDR.pack(READ_REQ, 0, 0, 1, 7, local.cache_id, 4096) + runs)
            got = b""
            while len(got) < HDR.size + 4096:
                got += await asyncio.get_running_loop().sock_recv(peer, 1 << 16)
            await asyncio.sleep(0.05)
            with pytest.raises(BlockingIOError):
                peer.recv(1)  # nothing follows the reply
        kind, _f, _r, _c, req_id, status, total = HDR.unpack(got[: HDR.size])
        assert (kind, req_id, status, total) == (READ_RSP, 7, 0, 4096)
        assert got[HDR.size :] == arr[5 * 4096 : 6 * 4096].tobytes()
        assert offers == ([] if taken is None else [taken])
        assert local.inflight == 0 and not local.pins and not ch._sendq and not broken
    finally:
        ch.close()
        peer.close()



@pytest.mark.asyncio
@pytest.mark.parametrize("first, taken", [(4096, None), (4096, 0), (4096, 10), (1000, None)],
                         ids=["whole", "answer-queued", "answer-in-part", "payload-in-pieces"])
async def test_a_small_write_of_the_peers_lands_and_is_answered_once(first: int, taken: int | None) -> None:
    """A peer's small write is read with its run table and answered at once, ahead of the queue. The
    raw peer sends the header, runs and ``first`` payload bytes, the rest 50 ms later; ``taken``
    stands in for the kernel taking none or 10 bytes of the answer (as in the read test above). The
    block holds exactly the peer's bytes, one answer comes back, and nothing stays pinned."""
    import struct

    from kvflow._tcp import HDR, WRITE_REQ, WRITE_RSP

    arr = np.random.default_rng(6).integers(0, 256, 16 * 4096, dtype=np.uint8)
    before = arr.copy()
    local, ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [16, 4096]), arr)
    offers = _kernel_takes(ch, ours, taken)
    payload = np.random.default_rng(first).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    try:
        async with asyncio.timeout(10):
            runs = struct.pack("<2Q", int(arr.ctypes.data) + 7 * 4096, 4096)
            peer.sendall(HDR.pack(WRITE_REQ, 0, 0, 1, 5, local.cache_id, 4096) + runs + payload[:first])
            await asyncio.sleep(0.05)
            peer.sendall(payload[first:])
            got = b""
            while len(got) < HDR.size:
                got += await asyncio.get_running_loop().sock_recv(peer, 1 << 16)
            await asyncio.sleep(0.05)
            with pytest.raises(BlockingIOError):
                peer.recv(1)  # one answer, nothing after it
        assert HDR.unpack(got) == (WRITE_RSP, 0, 0, 0, 5, 0, 0)
        assert arr[7 * 4096 : 8 * 4096].tobytes() == payload
        others = np.r_[0 : 7 * 4096, 8 * 4096 : 16 * 4096]
        assert np.array_equal(arr[others], before[others])
        assert offers == ([] if taken is None else [taken])
        assert local.inflight == 0 and not local.pins and not ch._sendq and not broken
        assert ch._serving_frames == 0 and ch._state == 0
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("runs", [1, 2])
@pytest.mark.parametrize("split", [None, 8, 32, 40, 48], ids=["whole", "in-header", "after-header", "in-first-run",
                                                              "after-first-run"])
async def test_requests_read_with_their_first_run_are_served_in_order(runs: int, split: int | None) -> None:
    """With nothing of ours pending, the reader asks the socket for a header and a run at once. A
    raw peer sends a read request of ``runs`` runs cut at byte ``split`` (the rest 50 ms later),
    with a second one-run request straight behind it: both are answered in order, each with
    exactly its blocks, and the reader ends waiting for a header with nothing left over."""
    import struct

    from kvflow._tcp import HDR, READ_REQ, READ_RSP

    arr = np.random.default_rng(7).integers(0, 256, 16 * 4096, dtype=np.uint8)
    local, _ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [16, 4096]), arr)
    base = int(arr.ctypes.data)
    blocks = [2, 9][:runs]
    first = HDR.pack(READ_REQ, 0, 0, runs, 1, local.cache_id, 4096 * runs) + b"".join(
        struct.pack("<2Q", base + b * 4096, 4096) for b in blocks)
    second = HDR.pack(READ_REQ, 0, 0, 1, 2, local.cache_id, 4096) + struct.pack("<2Q", base + 13 * 4096, 4096)
    try:
        async with asyncio.timeout(10):
            cut = len(first) if split is None else split
            peer.sendall(first[:cut])
            await asyncio.sleep(0.05)
            peer.sendall(first[cut:] + second)
            want = (HDR.size + 4096 * runs) + (HDR.size + 4096)
            got = b""
            while len(got) < want:
                got += await asyncio.get_running_loop().sock_recv(peer, 1 << 17)
            await asyncio.sleep(0.05)
            with pytest.raises(BlockingIOError):
                peer.recv(1)  # two answers, nothing after them
        one = HDR.size + 4096 * runs
        assert HDR.unpack(got[: HDR.size]) == (READ_RSP, 0, 0, 0, 1, 0, 4096 * runs)
        assert got[HDR.size : one] == b"".join(arr[b * 4096 : (b + 1) * 4096].tobytes() for b in blocks)
        assert HDR.unpack(got[one : one + HDR.size]) == (READ_RSP, 0, 0, 0, 2, 0, 4096)
        assert got[one + HDR.size :] == arr[13 * 4096 : 14 * 4096].tobytes()
        assert not broken and ch._state == 0 and ch._got == 0
        assert ch._serving_frames == 0 and local.inflight == 0
    finally:
        ch.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_response_to_nothing_read_with_a_run_breaks_the_link() -> None:
    """Attack: a peer sends a write response when nothing of ours is pending, followed by 16 bytes
    that the reader takes in the same ``recv`` as the header. The link breaks with a protocol
    error, the connection closes with no reply sent, and our memory is untouched."""
    from kvflow import LLMLinkFailed
    from kvflow._tcp import HDR, WRITE_RSP

    arr = np.random.default_rng(8).integers(0, 256, 4096, dtype=np.uint8)
    before = arr.copy()
    local, _ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [1, 4096]), arr)
    try:
        peer.sendall(HDR.pack(WRITE_RSP, 0, 0, 0, 3, 0, 0) + bytes(range(16)))
        async with asyncio.timeout(10):
            while not broken:
                await asyncio.sleep(0.01)
        assert isinstance(broken[0], LLMLinkFailed) and "protocol error" in str(broken[0])
        assert np.array_equal(arr, before) and local.inflight == 0
        async with asyncio.timeout(10):
            assert await asyncio.get_running_loop().sock_recv(peer, 1) == b""  # closed, nothing sent first
    finally:
        ch.close()
        peer.close()


# ---------------------------------------------------------------------- the exchange inside the call
def _recv_exact(sock: Any, n: int) -> bytes:
    got = b""
    while len(got) < n:
        part = sock.recv(n - len(got))
        if not part:
            raise ConnectionResetError("closed")
        got += part
    return got


class _ShortSends:
    """Our socket, except that its first ``sendmsg`` hands the kernel only ``first`` bytes (really
    sent): the rest of that frame must go out from the channel's queue. A short send cannot be
    arranged to the byte on loopback, hence this stand-in around the real socket."""

    def __init__(self, sock: Any, first: int) -> None:
        self._sock = sock
        self._first: int | None = first

    def sendmsg(self, bufs: list[Any]) -> int:
        if self._first is None:
            return int(self._sock.sendmsg(bufs))
        n, self._first = self._sock.send(b"".join(bufs)[: self._first]), None
        return int(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["whole", "in-pieces", "peer-request-first", "refused", "closed-after-header",
                                 "push-whole", "push-refused", "push-short-send"])
async def test_a_small_transfer_inside_the_call_against_a_raw_peer(how: str) -> None:
    """``now_rows`` with a 2 s inline window against a raw peer thread that answers as ``how`` says.
    The usual exchange makes no request object; every other answer hands over to the reader's state
    machine inside the same call: the block holds exactly the peer's bytes (or is untouched when the
    peer refused or went away), errors are typed, and nothing stays in flight."""
    import struct
    import threading

    from kvflow import LLMKvCacheNotExist, LLMLinkFailed, LLMStatusCode
    from kvflow._tcp import HDR, READ_REQ, READ_RSP, WRITE_REQ, WRITE_RSP

    push = how.startswith("push")
    arr = np.random.default_rng(3).integers(0, 256, 16 * 4096, dtype=np.uint8)
    before = arr.copy()
    local, ours, peer, ch, broken = _raw_peer(CacheDesc(1, DataType.DT_UINT8, [16, 4096]), arr, 2.0)
    if how == "push-short-send":
        ch._sock = _ShortSends(ours, 1000)
    payload = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    seen: dict[str, Any] = {}
    refused = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)

    def answer() -> None:
        peer.setblocking(True)
        peer.settimeout(10)
        try:
            request = _recv_exact(peer, HDR.size + 16)
            kind, _f, _r, count, req_id, cache_id, total = HDR.unpack(request[: HDR.size])
            seen["request"] = (kind, count, cache_id, total, struct.unpack("<2Q", request[HDR.size :]))
            if push:
                seen["pushed"] = _recv_exact(peer, total)
                peer.sendall(HDR.pack(WRITE_RSP, 0, 0, 0, req_id, refused if how == "push-refused" else 0, 0))
            elif how == "whole":
                peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096) + payload)
            elif how == "in-pieces":
                peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096) + payload[:1000])
                time.sleep(0.02)
                peer.sendall(payload[1000:])
            elif how == "peer-request-first":  # the peer reads our block 5 before it answers us
                runs = struct.pack("<2Q", int(arr.ctypes.data) + 5 * 4096, 4096)
                peer.sendall(HDR.pack(READ_REQ, 0, 0, 1, 77, local.cache_id, 4096) + runs)
                seen["served"] = _recv_exact(peer, HDR.size + 4096)
                peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096) + payload)
            elif how == "refused":
                peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, refused, 0))
            else:  # closed-after-header
                peer.sendall(HDR.pack(READ_RSP, 0, 0, 0, req_id, 0, 4096))
                peer.close()
        except BaseException as exc:  # the test reports it
            seen["error"] = exc

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        rows = [[int(arr.ctypes.data) + 3 * 4096], [0x5000], [4096], [0], [0]]
        if how in ("refused", "push-refused"):
            with pytest.raises(LLMKvCacheNotExist):
                ch.now_rows(WRITE_REQ if push else READ_REQ, rows, local, 9)
        elif how == "closed-after-header":
            with pytest.raises(LLMLinkFailed, match="closed"):
                ch.now_rows(READ_REQ, rows, local, 9)
        else:
            assert ch.now_rows(WRITE_REQ if push else READ_REQ, rows, local, 9) == (4096, 1)
        thread.join(10)
        assert "error" not in seen, seen
        assert seen["request"] == (WRITE_REQ if push else READ_REQ, 1, 9, 4096, (0x5000, 4096))
        block = arr[3 * 4096 : 4 * 4096].tobytes()
        if push:
            assert seen["pushed"] == before[3 * 4096 : 4 * 4096].tobytes()
        elif how in ("refused", "closed-after-header"):
            assert block == before[3 * 4096 : 4 * 4096].tobytes()  # nothing landed
        else:
            assert block == payload
        if how == "peer-request-first":
            assert HDR.unpack(seen["served"][: HDR.size])[:6] == (READ_RSP, 0, 0, 0, 77, 0)
            assert seen["served"][HDR.size :] == before[5 * 4096 : 6 * 4096].tobytes()
        others = np.r_[0 : 3 * 4096, 4 * 4096 : 16 * 4096]
        assert np.array_equal(arr[others], before[others])  # no byte outside the block moved
        assert bool(broken) is (how == "closed-after-header")
        assert not ch._pending and not ch._sendq and local.inflight == 0
        if not broken:  # (a closed channel keeps its counts: nothing is sent on it again)
            assert ch._out_frames == 0 and ch._state == 0 and ch._got == 0  # the reader awaits a header
    finally:
        thread.join(10)
        ch.close()
        peer.close()
