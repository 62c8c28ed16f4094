"""Reliability (issue 6): liveness, deadlines, cancellation, safe unregister, hostile peers, limits.

Every test runs real processes (``tests/_relpeer.py``) over real loopback sockets; faults come
from SIGKILL / SIGSTOP of the peer process and from ``kvflow.testing.FaultProxy`` put between
the two sides (for one link, proxy connection 0 is the control connection, 1 the data one).
The guarantees tested here are written down in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import pytest_asyncio

import kvflow._link as link_mod
import kvflow._pump as pump
import kvflow._tcp as tcp
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMException,
    LLMKvCacheNotExist,
    LLMLinkFailed,
    LLMNotYetLink,
    LlmRole,
    LLMStatusCode,
    LLMTimeoutError,
    LLMWaitProcessTimeout,
)
from kvflow import _notes as notes
from kvflow import _wire as wire
from kvflow._proc import PeerProcess
from kvflow.testing import FaultProxy, inspect

from ._relpeer import Guarded, Peer, RawClient, many_main

PEER, LOCAL = 1, 2
U8 = int(DataType.DT_UINT8)
TCP = {"kvflow.Transports": "tcp"}
CONTROL, DATA = 0, 1  # proxy connection indices of the first link through a proxy


def desc(blocks: int, block_bytes: int, tensors: int = 2) -> CacheDesc:
    return CacheDesc(tensors, DataType.DT_UINT8, [blocks, block_bytes])


def spec(d: CacheDesc, seed: int | None) -> tuple[int, int, list[int], int | None]:
    return (d.num_tensors, U8, list(d.shape), seed)


async def make_dd(cluster: int = LOCAL, listen: bool = False, **opts: str) -> LlmDataDist:
    dd = LlmDataDist(cluster, LlmRole.DECODER)
    o = {**TCP, "llm.SyncKvCacheWaitTime": "5000"}
    if listen:
        o["llm.ListenIpInfo"] = "127.0.0.1:0"
    o.update(opts)
    await dd.initialize(o)
    return dd


async def link(dd: LlmDataDist, cluster: int, address: tuple[str, int], timeout_ms: int = 3000) -> LLMStatusCode:
    return (await dd.link_llm_clusters([ClusterInfo(cluster, [IpInfo(*address)])], timeout_ms))[0]


async def until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Wait (bounded) until ``pred()``; poll every millisecond (test code only)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def chan(dd: LlmDataDist, cluster: int = PEER) -> tcp.TcpChannel:
    ep = inspect.links(dd)[cluster].endpoint
    assert isinstance(ep, tcp.TcpEndpoint)
    return ep._ch


def assert_quiet(dd: LlmDataDist, cluster: int = PEER) -> None:
    """Nothing of ours is outstanding on the link and no cache is pinned."""
    link = inspect.links(dd)[cluster]
    assert link.healthy, link
    ch = chan(dd, cluster)
    assert not ch._pending and not ch._backlog and ch._out_frames == 0 and ch._out_runs == 0
    assert not link._pending
    for local in inspect.local_caches(dd):
        assert local.inflight == 0 and not local.pins, (local.cache_id, local.pins)
    for remote in link.remotes.values():
        assert remote.inflight == 0


def block_view(g: Guarded, tensor: int, blocks: range | list[int]) -> np.ndarray:
    s = g.desc.stride
    return np.concatenate([g.tensors[tensor][b * s:(b + 1) * s] for b in blocks])


def expected(seed: int, d: CacheDesc, tensor: int, blocks: range | list[int]) -> np.ndarray:
    ref = Guarded(d, seed)
    return block_view(ref, tensor, blocks)


@pytest_asyncio.fixture
async def cleanup() -> AsyncIterator[list[Any]]:
    """Things to close at the end of a test, whatever happened: peers, LlmDataDists, proxies."""
    items: list[Any] = []
    yield items
    for item in reversed(items):
        try:
            if isinstance(item, (Peer, PeerProcess)):
                item.stop()
            elif isinstance(item, LlmDataDist):
                await asyncio.wait_for(item.finalize(), 10)
            elif isinstance(item, FaultProxy):
                await item.close()
            elif isinstance(item, int):  # a pid that may be stopped
                try:
                    os.kill(item, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        except Exception as exc:  # cleanup must go on
            print("cleanup:", type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------- liveness
@pytest.mark.asyncio
async def test_sigkill_mid_transfer_fails_every_future_within_bound_then_relinks(cleanup: list[Any]) -> None:
    big = desc(64, 1 << 20, tensors=4)  # 256 MiB
    small = desc(8, 4096)
    peer = Peer(PEER, caches=[spec(big, -1), spec(small, 5)], options=TCP)
    cleanup.append(peer)
    dd = await make_dd()
    cleanup.append(dd)
    # filling 256 MiB holds this loop for about 1 s here, longer on a slow host: before linking, or
    # the peer may see no heartbeat for its 2 s and break the link before the pull begins
    dst = Guarded(big, None)
    sdst = Guarded(small, None)
    assert await link(dd, PEER, peer.address) == LLMStatusCode.LLM_SUCCESS
    cache = await dd.register_kv_cache(big, dst.tensors)
    scache = await dd.register_kv_cache(small, sdst.tensors)
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}

    def stamp(name: str) -> Callable[[asyncio.Future[Any]], None]:
        return lambda _f: ended.setdefault(name, loop.time())

    big_pull = asyncio.ensure_future(dd.pull_kv_blocks(CacheIndex(PEER, peer.caches[0]), cache, list(range(64)),
                                                       list(range(64)), timeout_in_millis=60000))
    big_pull.add_done_callback(stamp("big"))
    ch = chan(dd)
    await until(lambda: ch._state == tcp._ST_PAYLOAD and ch._left < (256 << 20) - (1 << 20), 20,
                "payload to be landing")
    # a control request (lookup of the small cache) and a queued data frame are in flight too
    small_pull = asyncio.ensure_future(dd.pull_kv_blocks(CacheIndex(PEER, peer.caches[1]), scache, [0], [0],
                                                         timeout_in_millis=60000))
    small_pull.add_done_callback(stamp("small"))
    await asyncio.sleep(0)
    killed = loop.time()
    peer.kill()
    for name, task in (("big", big_pull), ("small", small_pull)):
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(task, 10)
        assert isinstance(info.value, (LLMLinkFailed, LLMTimeoutError)), info.value
        assert ended[name] - killed < 2.0, f"{name} failed {ended[name] - killed:.2f} s after the kill"
    assert dd.link_info(PEER).state == "broken"
    with pytest.raises(LLMNotYetLink):
        await dd.pull_kv_blocks(CacheIndex(PEER, peer.caches[1]), scache, [0], [0])
    landed = dst.buf.copy()  # whatever arrived before the kill; nothing lands afterwards
    peer.stop()

    peer2 = Peer(PEER, caches=[spec(big, -1), spec(small, 5)], options=TCP)  # restarted, same cluster id
    cleanup.append(peer2)
    assert await link(dd, PEER, peer2.address) == LLMStatusCode.LLM_SUCCESS
    await dd.pull_kv_blocks(CacheIndex(PEER, peer2.caches[1]), scache, [0, 1], [0, 1])
    assert (block_view(sdst, 1, [0, 1]) == expected(5, small, 1, [0, 1])).all()
    assert (dst.buf == landed).all()
    assert dst.guards_ok() and sdst.guards_ok()
    assert_quiet(dd)


async def pull_until_heartbeat_breaks(dd: LlmDataDist, peer: Peer, src: CacheIndex, cache: Any, block: int) -> float:
    """Stop ``peer`` (SIGSTOP, resumed after), pull ``block`` with a long deadline: the seconds until
    the pull failed for want of heartbeats."""
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(LLMTimeoutError, match="heartbeat"):
            await dd.pull_kv_blocks(src, cache, [block], [block], timeout_in_millis=20000)
        return time.monotonic() - t0
    finally:
        os.kill(peer.pid, signal.SIGCONT)


@pytest.mark.asyncio
async def test_sigstop_deadline_then_heartbeat(cleanup: list[Any]) -> None:
    d = desc(16, 64 << 10)
    peer = Peer(PEER, caches=[spec(d, 7)], options=TCP)
    cleanup.append(peer)
    # phase 1: heartbeat far away; the per-call deadline ends the call, the link stays usable
    dd = await make_dd(**{"kvflow.HeartbeatTimeout": "10000"})
    cleanup.append(dd)
    assert await link(dd, PEER, peer.address) == LLMStatusCode.LLM_SUCCESS
    dst = Guarded(d, None)
    cache = await dd.register_kv_cache(d, dst.tensors)
    src = CacheIndex(PEER, peer.caches[0])
    await dd.pull_kv_blocks(src, cache, [15], [15])
    sentinel = 0x3C
    for t in dst.tensors:
        t[:] = sentinel
    os.kill(peer.pid, signal.SIGSTOP)
    cleanup.append(peer.pid)
    try:
        t0 = time.monotonic()
        with pytest.raises(LLMTimeoutError):
            await dd.pull_kv_blocks(src, cache, list(range(8)), list(range(8)), timeout_in_millis=400)
        took = time.monotonic() - t0
        assert 0.39 <= took < 1.0, took
        assert dd.link_info(PEER).state == "linked"
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    # the peer answers the abandoned read late: those bytes are drained, not written
    await dd.pull_kv_blocks(src, cache, list(range(8, 16)), list(range(8, 16)))
    for t in range(2):
        assert (block_view(dst, t, range(8)) == sentinel).all()
        assert (block_view(dst, t, range(8, 16)) == expected(7, d, t, range(8, 16))).all()
    assert dst.guards_ok()
    assert_quiet(dd)

    # phase 2: a long deadline; the heartbeat (1 s) breaks the link and fails the call
    dd2 = await make_dd(3, **{"kvflow.HeartbeatInterval": "200", "kvflow.HeartbeatTimeout": "1000"})
    cleanup.append(dd2)
    assert await link(dd2, PEER, peer.address) == LLMStatusCode.LLM_SUCCESS
    dst2 = Guarded(d, None)
    cache2 = await dd2.register_kv_cache(d, dst2.tensors)
    await dd2.pull_kv_blocks(src, cache2, [0], [0])
    took = await pull_until_heartbeat_breaks(dd2, peer, src, cache2, 1)
    assert took < 1.5, took
    assert dd2.link_info(PEER).state == "broken"
    # re-link (the peer still holds its side of the old link until it notices: it is replaced)
    assert await link(dd2, PEER, peer.address) == LLMStatusCode.LLM_SUCCESS
    await dd2.pull_kv_blocks(src, cache2, [1], [1])
    assert (block_view(dst2, 0, [1]) == expected(7, d, 0, [1])).all()
    assert_quiet(dd2)
    assert_quiet(dd)  # the other link went on working through all this


# ---------------------------------------------------------------------------------------- proxy faults
async def proxied(cleanup: list[Any], d: CacheDesc, seed: int, **opts: str
                  ) -> tuple[Peer, FaultProxy, LlmDataDist, Guarded, Any, CacheIndex]:
    """A peer with one cache, a proxy in front of it, and a local LlmDataDist linked through the proxy
    with a zeroed local cache of the same layout."""
    peer = Peer(PEER, caches=[spec(d, seed)], options={**TCP, **{k: v for k, v in opts.items()
                                                                 if k.startswith("kvflow.Heartbeat")}})
    cleanup.append(peer)
    proxy = await FaultProxy(peer.address).start()
    cleanup.append(proxy)
    dd = await make_dd(**opts)
    cleanup.append(dd)
    assert await link(dd, PEER, proxy.address) == LLMStatusCode.LLM_SUCCESS
    assert [c.index for c in proxy.live] == [CONTROL, DATA]
    dst = Guarded(d, None)
    cache = await dd.register_kv_cache(d, dst.tensors)
    src = CacheIndex(PEER, peer.caches[0])
    await dd.pull_kv_blocks(src, cache, [0], [0])  # looks the peer's cache up
    return peer, proxy, dd, dst, cache, src


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_data_stalled_mid_payload_late_bytes_are_discarded(cleanup: list[Any], how: str) -> None:
    d = desc(32, 256 << 10)  # 16 MiB
    _peer, proxy, dd, dst, cache, src = await proxied(cleanup, d, 11)
    proxy.stall(after=3 << 20, direction="down", conns=[DATA])
    call = dd.pull_kv_blocks(src, cache, list(range(16)), list(range(16)),
                             timeout_in_millis=500 if how == "deadline" else 30000)
    if how == "deadline":
        with pytest.raises(LLMTimeoutError):
            await call
    else:
        task = asyncio.ensure_future(call)
        ch = chan(dd)
        await until(lambda: ch._state == tcp._ST_PAYLOAD and ch._left < (8 << 20) - (1 << 20), 10, "payload")
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    snapshot = [block_view(dst, t, range(16)) for t in range(2)]  # what landed before the call raised
    assert sum(int((s != 0).sum()) for s in snapshot) > (1 << 20), "the stall was meant to come mid-payload"
    assert dd.link_info(PEER).state == "linked"
    proxy.resume()
    await dd.pull_kv_blocks(src, cache, list(range(16, 32)), list(range(16, 32)))
    for t in range(2):
        assert (block_view(dst, t, range(16)) == snapshot[t]).all(), "a late byte landed after the call raised"
        assert (block_view(dst, t, range(16, 32)) == expected(11, d, t, range(16, 32))).all()
    assert dst.guards_ok()
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_a_payload_stalled_past_hold_s_waits_in_epoll_not_on_a_thread(cleanup: list[Any],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker thread gives back a payload whose socket stayed empty for ``HOLD_S``; the loop's
    reader then waits for the next byte, rather than hand the payload straight back to a thread that
    polls the same empty socket again (every ``HOLD_S``, for as long as the peer stalls). Once the
    peer resumes, the payload goes on and lands exact."""
    monkeypatch.setattr(pump, "HOLD_S", 0.02)
    starts: list[int] = []
    receive = pump.Pool.receive

    def counted(pool: pump.Pool, sock: socket.socket, job: pump.Job) -> Any:
        starts.append(job.left)
        return receive(pool, sock, job)

    monkeypatch.setattr(pump.Pool, "receive", counted)
    d = desc(32, 256 << 10)  # 16 MiB
    _peer, proxy, dd, dst, cache, src = await proxied(cleanup, d, 12)
    proxy.stall(after=3 << 20, direction="down", conns=[DATA])
    task = asyncio.ensure_future(dd.pull_kv_blocks(src, cache, list(range(16)), list(range(16)),
                                                   timeout_in_millis=30000))
    ch = chan(dd)
    await until(lambda: bool(starts) and ch._rx_job is None and ch._state == tcp._ST_PAYLOAD, 10,
                "the stalled payload handed back")
    # The proxy runs on this loop and may forward its last pre-stall bytes after a thread has given
    # the payload back; those bytes rightly send it to a thread once more. So wait until the hand-backs
    # stop for five HOLD_S (never, if it went back every HOLD_S), then count.
    deadline = time.monotonic() + 10
    while True:
        seen = len(starts)
        await asyncio.sleep(0.1)
        if len(starts) == seen and ch._rx_job is None:
            break
        assert time.monotonic() < deadline, "the stalled payload kept going back to a thread"
    before = len(starts)
    await asyncio.sleep(0.4)  # twenty times HOLD_S, the peer still stalled
    assert len(starts) == before, f"the stalled payload went back to a thread {len(starts) - before} times"
    proxy.resume()
    await asyncio.wait_for(task, 10)
    for t in range(2):
        assert (block_view(dst, t, range(16)) == expected(12, d, t, range(16))).all()
    assert dst.guards_ok()
    assert_quiet(dd)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["drop", "reset", "truncate_data"])
async def test_connection_cut_mid_transfer_fails_fast_then_relinks(cleanup: list[Any], fault: str) -> None:
    d = desc(32, 256 << 10)
    _peer, proxy, dd, dst, cache, src = await proxied(cleanup, d, 12)
    proxy.stall(after=2 << 20, direction="down", conns=[DATA])
    task = asyncio.ensure_future(dd.pull_kv_blocks(src, cache, list(range(32)), list(range(32)),
                                                   timeout_in_millis=30000))
    await until(lambda: proxy.connections[DATA].down.forwarded >= 2 << 20, 10, "2 MiB forwarded")
    t0 = time.monotonic()
    if fault == "truncate_data":
        proxy.truncate(64 << 10, direction="down", conns=[DATA])
    else:
        proxy.drop(reset=fault == "reset")
    with pytest.raises(LLMLinkFailed):
        await asyncio.wait_for(task, 10)
    assert time.monotonic() - t0 < 1.0
    assert dd.link_info(PEER).state == "broken"
    proxy.resume()
    assert await link(dd, PEER, proxy.address) == LLMStatusCode.LLM_SUCCESS
    await dd.pull_kv_blocks(src, cache, [3, 4], [3, 4])
    assert (block_view(dst, 1, [3, 4]) == expected(12, d, 1, [3, 4])).all()
    assert dst.guards_ok()
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_default_heartbeat_rides_out_a_short_stall_and_breaks_a_stopped_peer_1_to_3_5_s_after_the_stop(
        cleanup: list[Any]) -> None:
    """The defaults (a ping every 666 ms, 2 s of silence) as docs/reliability.md states them: a
    peer stopped for 0.6 s keeps its link; one stopped for good is declared dead 2 s after it was
    last heard, which is 1.17-2 s after it stopped, plus scheduling."""
    d = desc(4, 64 << 10)
    peer = Peer(PEER, caches=[spec(d, 5)], options=TCP)
    cleanup.append(peer)
    dd = await make_dd()
    cleanup.append(dd)
    assert await link(dd, PEER, peer.address) == LLMStatusCode.LLM_SUCCESS
    dst = Guarded(d, None)
    cache = await dd.register_kv_cache(d, dst.tensors)
    src = CacheIndex(PEER, peer.caches[0])
    await dd.pull_kv_blocks(src, cache, [0], [0])
    cleanup.append(peer.pid)
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(0.6)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    await asyncio.sleep(0.5)
    assert dd.link_info(PEER).state == "linked"
    await dd.pull_kv_blocks(src, cache, [1], [1])
    took = await pull_until_heartbeat_breaks(dd, peer, src, cache, 2)
    assert 1.0 <= took < 3.5, took  # 2 s after it was last heard, at most 0.83 s before the stop
    for t in range(2):
        assert (block_view(dst, t, [0, 1]) == expected(5, d, t, [0, 1])).all()
    assert dst.guards_ok()


@pytest.mark.asyncio
async def test_everything_stalled_heartbeat_breaks_link_both_sides_then_relinks(cleanup: list[Any]) -> None:
    d = desc(8, 64 << 10)
    hb = {"kvflow.HeartbeatInterval": "100", "kvflow.HeartbeatTimeout": "600"}
    peer, proxy, dd, dst, cache, src = await proxied(cleanup, d, 13, **hb)
    proxy.stall()
    t0 = time.monotonic()
    with pytest.raises(LLMTimeoutError, match="heartbeat"):
        await dd.pull_kv_blocks(src, cache, [1], [1], timeout_in_millis=20000)
    took = time.monotonic() - t0
    assert 0.45 <= took < 1.2, took  # 600 ms after the last ping heard, up to 125 ms before the stall
    # the peer's side breaks too (it hears nothing either)
    await until_peer_link_state(peer, LOCAL, "broken", 3.0)
    proxy.resume()
    assert await link(dd, PEER, proxy.address) == LLMStatusCode.LLM_SUCCESS
    await dd.pull_kv_blocks(src, cache, [1], [1])
    assert (block_view(dst, 0, [1]) == expected(13, d, 0, [1])).all()
    assert_quiet(dd)


async def until_peer_link_state(peer: Peer, cluster: int, state: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (await peer.call("links")).get(cluster) != state:
        if time.monotonic() > deadline:
            raise AssertionError(f"peer's link to {cluster} never became {state}: {await peer.call('links')}")
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------------------- cancellation
@pytest.mark.asyncio
async def test_cancel_one_caller_of_a_shared_lookup_leaves_the_other_alone(cleanup: list[Any]) -> None:
    d = desc(8, 4096)
    peer, proxy, dd, dst, cache, _src = await proxied(cleanup, d, 14)
    other = CacheIndex(PEER, await peer.call("register", *spec(d, 15)))
    proxy.stall(conns=[CONTROL])  # the lookup of ``other`` waits on the control connection
    a = asyncio.ensure_future(dd.pull_kv_blocks(other, cache, [2], [2]))
    b = asyncio.ensure_future(dd.pull_kv_blocks(other, cache, [3], [3]))
    await asyncio.sleep(0.1)
    assert not a.done() and not b.done()
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    proxy.resume()
    await asyncio.wait_for(b, 5)
    assert (block_view(dst, 0, [3]) == expected(15, d, 0, [3])).all()
    assert (block_view(dst, 0, [2]) == 0).all()
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_cancel_at_many_points(cleanup: list[Any]) -> None:
    """Cancel one pull after k loop iterations, for many k: the call ends, no byte lands after it
    raised, nothing stays pinned or outstanding, the link stays usable."""
    d = desc(64, 128 << 10)  # 16 MiB; pulls of 24 blocks = 6 MiB, several readable callbacks
    _peer, _proxy, dd, dst, cache, src = await proxied(cleanup, d, 16)
    outcomes = {"cancelled": 0, "completed": 0}
    for i, k in enumerate([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]):
        for t in dst.tensors:
            t[:] = 0x77
        blocks = list(range(24)) if i % 2 == 0 else list(range(24, 48))
        task = asyncio.ensure_future(dd.pull_kv_blocks(src, cache, blocks, blocks))
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            outcomes["completed"] += 1
            continue
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
        snap = [dst.tensors[t].copy() for t in range(2)]
        # a pull of other blocks is answered after the abandoned one: once it is done, any late byte would have landed
        await dd.pull_kv_blocks(src, cache, [63], [63])
        for t in range(2):
            changed = np.flatnonzero(dst.tensors[t] != snap[t])
            assert changed.size == 0 or changed.min() >= 63 * d.stride, (k, changed[:4])
        await until(lambda: chan(dd)._out_frames == 0, 5, "abandoned frames to drain")
        assert_quiet(dd)
    assert outcomes["cancelled"] >= 5, outcomes
    assert dst.guards_ok()


@pytest.mark.asyncio
async def test_cancel_frames_waiting_for_room_and_on_the_wire(cleanup: list[Any]) -> None:
    d = desc(512, 4096)
    _peer, proxy, dd, dst, cache, src = await proxied(cleanup, d, 17)
    proxy.stall(direction="down", conns=[DATA])  # requests go out, no response comes back
    n = tcp.MAX_OUTSTANDING_FRAMES + 44
    tasks = [asyncio.ensure_future(dd.pull_kv_blocks(src, cache, [1 + i], [1 + i], timeout_in_millis=30000))
             for i in range(n)]
    ch = chan(dd)
    await until(lambda: ch._out_frames == tcp.MAX_OUTSTANDING_FRAMES and len(ch._backlog) == 44, 5, "backlog")
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert not ch._backlog
    local = inspect.local_cache(dd, cache.cache_id)
    assert local.inflight == 0
    proxy.resume()
    await until(lambda: ch._out_frames == 0, 5, "abandoned responses to be drained")
    assert (dst.buf[dst.tensors[0].ctypes.data - dst.buf.ctypes.data + d.stride:][:n * d.stride] == 0).all()
    await dd.pull_kv_blocks(src, cache, [400], [400])
    assert (block_view(dst, 1, [400]) == expected(17, d, 1, [400])).all()
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_backpressure_bounds_outstanding_frames(cleanup: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    d = desc(2048, 1024, tensors=1)
    _peer, _proxy, dd, dst, cache, src = await proxied(cleanup, d, 18)
    seen = {"max": 0}
    admit = tcp.TcpChannel._admit

    def watched(self: tcp.TcpChannel) -> None:
        admit(self)
        seen["max"] = max(seen["max"], self._out_frames)
        assert self._out_frames <= tcp.MAX_OUTSTANDING_FRAMES and self._out_runs <= tcp.MAX_OUTSTANDING_RUNS

    monkeypatch.setattr(tcp.TcpChannel, "_admit", watched)
    blocks = list(range(1, 2048))
    await asyncio.gather(*(dd.pull_kv_blocks(src, cache, [b], [b]) for b in blocks))
    assert seen["max"] == tcp.MAX_OUTSTANDING_FRAMES
    assert (block_view(dst, 0, blocks) == expected(18, d, 0, blocks)).all()
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_cancelled_push_keeps_its_source_pinned_until_the_frame_is_sent(cleanup: list[Any]) -> None:
    d = desc(32, 1 << 20)  # the push is 32 MiB: more than the socket buffers hold
    peer, proxy, dd, mine, cache, dst_index = await proxied(cleanup, d, 19)
    mine.fill(20)
    proxy.stall(after=2 << 20, direction="up", conns=[DATA])
    task = asyncio.ensure_future(dd.push_kv_blocks(cache, dst_index, list(range(16)), list(range(16))))
    await until(lambda: proxy.connections[DATA].up.forwarded >= 2 << 20, 10, "2 MiB forwarded")
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    local = inspect.local_cache(dd, cache.cache_id)
    assert local.pins == {chan(dd): 1}, "the frame on the wire still reads the source"
    proxy.resume()
    await until(lambda: not local.pins, 5, "the frame to be sent")
    await dd.push_kv_blocks(cache, dst_index, list(range(16)), list(range(16)))  # the retry lands whole
    assert await peer.call("crcs", dst_index.cache_id, list(range(16))) == mine.crcs(list(range(16)))
    assert_quiet(dd)


# ---------------------------------------------------------------------------------------- safe unregister
async def served(cleanup: list[Any], descs: list[CacheDesc], seed: int
                 ) -> tuple[LlmDataDist, Peer, FaultProxy, list[tuple[Guarded, Any]]]:
    """We listen with ``descs`` registered (filled from ``seed``); the peer (with a zeroed cache of each
    layout) links to us through a proxy: "up" is peer -> us, "down" is us -> peer."""
    dd = await make_dd(listen=True)
    cleanup.append(dd)
    mine = []
    for i, d in enumerate(descs):
        g = Guarded(d, seed + i)
        mine.append((g, await dd.register_kv_cache(d, g.tensors)))
    peer = Peer(PEER, caches=[spec(d, None) for d in descs], options=TCP)
    cleanup.append(peer)
    assert dd.listen_address is not None
    proxy = await FaultProxy(dd.listen_address).start()
    cleanup.append(proxy)
    assert await peer.call("link", LOCAL, *proxy.address, 3000) == 0
    return dd, peer, proxy, mine


async def stalled_peer_read(cleanup: list[Any], seed: int) -> tuple[Any, Peer, FaultProxy, Any, Any,
                                                                    asyncio.Future[Any]]:
    """A peer pulling all 32 blocks of our cache, stalled after 2 MiB of the answer crossed the proxy."""
    dd, peer, proxy, [(g, cache)] = await served(cleanup, [desc(32, 256 << 10)], seed)
    proxy.stall(after=2 << 20, direction="down", conns=[DATA])
    blocks = list(range(32))
    pull = asyncio.ensure_future(peer.call("pull_blocks", LOCAL, cache.cache_id, peer.caches[0], blocks, blocks,
                                           30000))
    await until(lambda: proxy.connections[DATA].down.forwarded >= 2 << 20, 10, "2 MiB forwarded")
    return dd, peer, proxy, g, cache, pull


@pytest.mark.asyncio
async def test_unregister_waits_for_a_peer_read_in_progress(cleanup: list[Any]) -> None:
    dd, peer, proxy, g, cache, pull = await stalled_peer_read(cleanup, 30)
    local = inspect.local_cache(dd, cache.cache_id)
    assert local.inflight == 1
    unreg = asyncio.ensure_future(dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=10000))
    await asyncio.sleep(0.3)
    assert not unreg.done(), "unregister must wait for the peer's read"
    proxy.resume()
    await asyncio.wait_for(unreg, 10)
    await asyncio.wait_for(pull, 10)  # the read finished whole
    assert await peer.call("crcs", peer.caches[0], None) == g.crcs()
    with pytest.raises(LLMKvCacheNotExist):
        await peer.call("pull_blocks", LOCAL, cache.cache_id, peer.caches[0], [0], [0], 3000)
    assert dd.link_info(PEER).state == "linked"
    assert (await peer.call("links"))[LOCAL] == "linked"


@pytest.mark.asyncio
async def test_a_second_unregister_of_the_same_cache_returns_only_with_the_first(cleanup: list[Any]) -> None:
    """Two unregisters of one cache while a peer's read of it is stalled: the second returns once the
    first has ended, not at once (which told its caller to free memory the first call was still
    waiting to stop the peer reading). A second call whose own deadline comes first says the cache
    stays registered."""
    dd, peer, proxy, g, cache, pull = await stalled_peer_read(cleanup, 33)
    first = asyncio.ensure_future(dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=10000))
    await asyncio.sleep(0.1)
    with pytest.raises(LLMWaitProcessTimeout, match="still being unregistered by another call"):
        await dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=200)
    assert not first.done()
    second = asyncio.ensure_future(dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=10000))
    await asyncio.sleep(0.3)
    assert not second.done(), "the second unregister returned while the first still waits for the peer"
    proxy.resume()
    await asyncio.wait_for(first, 10)
    await asyncio.wait_for(second, 10)
    assert inspect.local_cache(dd, cache.cache_id) is None
    await asyncio.wait_for(pull, 10)  # the read finished whole before the cache went
    assert await peer.call("crcs", peer.caches[0], None) == g.crcs()


@pytest.mark.asyncio
async def test_unregister_deadline_cuts_a_stalled_peer_read(cleanup: list[Any]) -> None:
    dd, peer, proxy, _g, cache, pull = await stalled_peer_read(cleanup, 31)
    local = inspect.local_cache(dd, cache.cache_id)
    assert local.inflight == 1, "the proxy's buffers must not hold the whole answer"
    t0 = time.monotonic()
    await dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)
    assert time.monotonic() - t0 < 1.0
    assert local.inflight == 0 and not local.pins
    assert inspect.local_cache(dd, cache.cache_id) is None
    # the read was half sent and cannot be taken back: the data connection was closed
    assert dd.link_info(PEER).state == "broken"
    proxy.resume()
    with pytest.raises(LLMException) as info:
        await asyncio.wait_for(pull, 10)
    assert isinstance(info.value, (LLMLinkFailed, LLMTimeoutError)), info.value
    # the peer links again and finds the cache gone
    await until_peer_link_state(peer, LOCAL, "broken", 5)
    assert await peer.call("link", LOCAL, *proxy.address, 3000) == 0
    with pytest.raises(LLMKvCacheNotExist):
        await peer.call("pull_blocks", LOCAL, cache.cache_id, peer.caches[0], [0], [0], 3000)


@pytest.mark.asyncio
async def test_unregister_deadline_diverts_a_stalled_peer_write(cleanup: list[Any]) -> None:
    d = desc(32, 256 << 10)
    other = desc(4, 4096)
    dd, peer, proxy, [(g, cache), (g2, cache2)] = await served(cleanup, [d, other], 32)
    await peer.call("fill", peer.caches[0], 99)
    proxy.stall(after=2 << 20, direction="up", conns=[DATA])
    blocks = list(range(32))
    push = asyncio.ensure_future(peer.call("push_blocks", LOCAL, cache.cache_id, peer.caches[0], blocks, blocks,
                                           30000))
    ch = chan(dd)
    local = inspect.local_cache(dd, cache.cache_id)
    await until(lambda: ch._payload_pin is local and ch._left < (16 << 20) - (1 << 20), 10, "payload landing")
    t0 = time.monotonic()
    await dd.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)
    assert time.monotonic() - t0 < 1.0
    assert local.inflight == 0 and not local.pins
    # the memory is ours again: reuse it; the rest of the peer's write must not land in it
    for t in g.tensors:
        t[:] = 0x5A
    proxy.resume()
    with pytest.raises(LLMKvCacheNotExist):
        await asyncio.wait_for(push, 10)
    assert all((t == 0x5A).all() for t in g.tensors), "a byte landed after unregister returned"
    assert g.guards_ok()
    # nothing else was disturbed: same link, other caches still served
    assert dd.link_info(PEER).state == "linked"
    await peer.call("pull_blocks", LOCAL, cache2.cache_id, peer.caches[1], [1, 2], [1, 2], 3000)
    assert await peer.call("crcs", peer.caches[1], [1, 2]) == g2.crcs([1, 2])
    assert_quiet(dd)


@pytest.mark.asyncio
async def test_unregister_answers_queued_peer_reads_without_cutting_the_link(cleanup: list[Any]) -> None:
    big, small = desc(32, 256 << 10), desc(4, 4096)
    dd, peer, proxy, [(g, cache), (_g2, cache2)] = await served(cleanup, [big, small], 33)
    proxy.stall(after=2 << 20, direction="down", conns=[DATA])
    blocks = list(range(32))
    pull_big = asyncio.ensure_future(peer.call("pull_blocks", LOCAL, cache.cache_id, peer.caches[0], blocks, blocks,
                                               30000))
    await until(lambda: proxy.connections[DATA].down.forwarded >= 2 << 20, 10, "2 MiB forwarded")
    pull_small = asyncio.ensure_future(peer.call("pull_blocks", LOCAL, cache2.cache_id, peer.caches[1], [0, 1],
                                                 [0, 1], 30000))
    ch = chan(dd)
    local2 = inspect.local_cache(dd, cache2.cache_id)
    await until(lambda: any(o.pinned is local2 and o.idx == -1 for o in ch._sendq), 10, "queued response")
    await dd.unregister_kv_cache(cache2.cache_id, timeout_in_millis=300)
    assert local2.inflight == 0
    assert dd.link_info(PEER).state == "linked"
    proxy.resume()
    await asyncio.wait_for(pull_big, 10)
    assert await peer.call("crcs", peer.caches[0], None) == g.crcs()
    with pytest.raises(LLMKvCacheNotExist):
        await asyncio.wait_for(pull_small, 10)
    zero = zlib.crc32(bytes(small.stride))
    assert await peer.call("crcs", peer.caches[1], [0, 1]) == [[zero, zero], [zero, zero]]  # nothing landed
    assert_quiet(dd)


# ---------------------------------------------------------------------------------------- hostile peers
async def server(cleanup: list[Any], d: CacheDesc | None = None, seed: int = 40, **opts: str
                 ) -> tuple[LlmDataDist, Guarded | None, Any]:
    """An LlmDataDist (cluster PEER) listening in this process, with one guarded cache."""
    srv = await make_dd(PEER, listen=True, **opts)
    cleanup.append(srv)
    if d is None:
        return srv, None, None
    g = Guarded(d, seed)
    return srv, g, await srv.register_kv_cache(d, g.tensors)


async def serves_a_real_client(srv: LlmDataDist, cache: Any, g: Guarded, cleanup: list[Any],
                               cluster: int = 7, **opts: str) -> None:
    """After whatever happened, a well-behaved peer links and pulls correct bytes."""
    dd = await make_dd(cluster, **opts)
    cleanup.append(dd)
    assert srv.listen_address is not None
    assert await link(dd, PEER, srv.listen_address) == LLMStatusCode.LLM_SUCCESS
    dst = Guarded(g.desc, None)
    mine = await dd.register_kv_cache(g.desc, dst.tensors)
    blocks = list(range(g.desc.num_blocks))
    await dd.pull_kv_blocks(CacheIndex(PEER, cache.cache_id), mine, blocks, blocks)
    assert dst.crcs() == g.crcs()
    await dd.finalize()


@pytest.mark.asyncio
async def test_version_mismatch_fails_the_link_clearly(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d)
    assert srv.listen_address is not None

    def old_client() -> dict[str, Any] | None:
        c = RawClient(srv.listen_address)
        try:
            return c.hello(9, PEER, v=99)
        finally:
            c.close()

    rsp = await asyncio.to_thread(old_client)
    assert rsp is not None and rsp["t"] == "reject"
    assert rsp["code"] == LLMStatusCode.LLM_LINK_FAILED and "version" in rsp["msg"]

    # the other way round: a server that speaks another version, and one that "rejects" with code 0
    async def fake(reply: dict[str, Any]) -> LLMStatusCode:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(wire.MAGIC_SIZE)
            await wire.read_frame(reader)
            writer.write(wire.pack(reply))
            await reader.read()  # until the client hangs up
            writer.close()

        fake_srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            dd = await make_dd(8)
            try:
                return await link(dd, PEER, fake_srv.sockets[0].getsockname()[:2])
            finally:
                await dd.finalize()
        finally:
            fake_srv.close()

    assert await fake({"t": "welcome", "m": msgpack.packb({"v": 99, "cluster": PEER})}) == LLMStatusCode.LLM_LINK_FAILED
    assert await fake({"t": "reject", "code": 0, "msg": "ha"}) == LLMStatusCode.LLM_LINK_FAILED
    assert await fake({"t": "nonsense"}) == LLMStatusCode.LLM_LINK_FAILED
    assert g is not None
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_handshake_abuse_is_closed_within_bounds(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d, **{"kvflow.HeartbeatInterval": "100",
                                                "kvflow.HeartbeatTimeout": "1000"})
    addr = srv.listen_address
    assert addr is not None and g is not None

    def abuse(what: str) -> float:
        c = RawClient(addr)
        try:
            t0 = time.monotonic()
            if what == "partial_magic":
                c.send(wire.MAGIC_CONTROL[:5])
            elif what == "garbage_magic":
                c.send(b"GET / HTTP/1.1\r\n\r\n")
            elif what == "partial_hello":
                c.send(wire.MAGIC_CONTROL + struct.pack("<I", 100) + b"\x81")
            elif what == "oversized":
                c.send(wire.MAGIC_CONTROL + struct.pack("<I", wire.MAX_FRAME + 1))
            elif what == "not_a_map":
                c.send(wire.MAGIC_CONTROL)
                c.send_msg([1, 2, 3])
            elif what == "unknown_token":
                c.send(wire.MAGIC_DATA + os.urandom(wire.TOKEN_SIZE))
            elif what == "no_data_connection":  # completes hello, never opens the data connection
                welcome = c.hello(9, PEER)
                assert welcome is not None and welcome["t"] == "welcome"
                c.send_sealed("choose", {"transport": "tcp", "info": {}})
            closed = c.closed_within(5.0)
            assert closed, what
            return time.monotonic() - t0
        finally:
            c.close()

    took = {}
    for what in ("silent", "partial_magic", "garbage_magic", "partial_hello", "oversized", "not_a_map",
                 "unknown_token", "no_data_connection"):
        took[what] = await asyncio.to_thread(abuse, what)
    for what in ("garbage_magic", "oversized", "not_a_map"):
        assert took[what] < 0.5, took  # refused at once
    assert max(took.values()) < 2.5, took  # the others at the handshake timeout (1 s here, twice at most)
    assert not inspect.linking(srv) and not inspect.data_waiters(srv) and len(inspect.links(srv)) == 0
    await serves_a_real_client(srv, cache, g, cleanup, cluster=9)  # cluster 9 was left half-linked above


@pytest.mark.asyncio
async def test_link_to_a_silent_server_fails_at_its_deadline(cleanup: list[Any]) -> None:
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # accepts (in the kernel), never answers
    try:
        dd = await make_dd()
        cleanup.append(dd)
        t0 = time.monotonic()
        assert await link(dd, PEER, hole.getsockname()[:2], timeout_ms=500) == LLMStatusCode.LLM_TIMEOUT
        assert 0.45 < time.monotonic() - t0 < 1.5
        assert PEER not in inspect.links(dd) and not inspect.linking(dd)
    finally:
        hole.close()


@pytest.mark.asyncio
async def test_control_request_flood_is_bounded(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d)
    addr = srv.listen_address
    assert addr is not None and g is not None
    handle = inspect.handler(srv)

    async def slow_or_not(link: Any, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") == "slow":  # stands for a request that waits (a peer's unregister draining)
            await asyncio.sleep(0.3)
            return {}
        return await handle(link, msg)

    inspect.replace_handler(srv, slow_or_not)

    def flood(op: str, n: int) -> list[dict[str, Any]]:
        c = RawClient(addr)
        try:
            c.handshake(9, PEER)
            c.send(b"".join(wire.pack({"t": "req", "id": i, "op": op, "cache_id": cache.cache_id})
                            for i in range(n)))
            answers = []
            while len(answers) < n:
                m = c.recv_msg()
                assert m is not None, f"closed after {len(answers)} answers"
                answers.append(m)
            return answers
        finally:
            c.close()

    # a burst of lookups (answered at once) is served whole, however large
    answers = await asyncio.to_thread(flood, "cache", 3000)
    assert sorted(a["id"] for a in answers) == list(range(3000))
    assert all(a["code"] == 0 and a["cache"]["addrs"] == list(cache.tensor_addrs) for a in answers)
    # requests that wait are bounded: the ones beyond MAX_SERVING are refused at once with LLM_LINK_BUSY
    t0 = time.monotonic()
    answers = await asyncio.to_thread(flood, "slow", 200)
    codes = [a["code"] for a in answers]
    assert codes.count(0) == link_mod.MAX_SERVING
    assert codes.count(LLMStatusCode.LLM_LINK_BUSY) == 200 - link_mod.MAX_SERVING
    assert time.monotonic() - t0 < 2.0
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_hostile_notifications_are_refused_and_never_queued(cleanup: list[Any]) -> None:
    """A linked peer's ``note`` requests: an oversized or ill-typed payload is refused with a status,
    as any malformed request, and queues nothing; well-formed ones are queued, in order, until the
    application takes them."""
    srv, g, cache = await server(cleanup, desc(4, 4096))
    addr = srv.listen_address
    assert addr is not None and g is not None

    def send(*payloads: Any) -> list[dict[str, Any] | None]:
        c = RawClient(addr)
        try:
            c.handshake(9, PEER)
            c.send(b"".join(wire.pack({"t": "req", "id": i, "op": "note", "payload": p})
                            for i, p in enumerate(payloads)))
            return [c.recv_msg() for _ in payloads]
        finally:
            c.close()

    answers = await asyncio.to_thread(send, b"first", b"second")
    assert [a and a["code"] for a in answers] == [0, 0]
    assert srv.get_notifications() == [(9, b"first"), (9, b"second")]
    for bad in (b"x" * (notes.MAX_PAYLOAD + 1), "text", 7, None, [b"a"]):
        answers = await asyncio.to_thread(send, bad)
        assert answers[0] is not None and answers[0]["code"] != 0, (bad, answers)
        assert srv.get_notifications() == []
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_peer_that_does_not_read_its_control_answers_loses_the_link(
        cleanup: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_mod, "MAX_WRITE_BUFFER", 256 << 10)
    d = CacheDesc(1024, DataType.DT_UINT8, [4, 16])  # a long description: ~10 KiB per answer
    srv, g, cache = await server(cleanup, d)
    addr = srv.listen_address
    assert addr is not None and g is not None
    c = await asyncio.to_thread(RawClient, addr)
    try:
        await asyncio.to_thread(c.handshake, 9, PEER)
        link9 = inspect.links(srv)[9]
        sent = 0
        for _ in range(500):  # bounded: 500 x 40 requests, far more than the buffers hold
            if not link9.healthy:
                break
            frames = b"".join(wire.pack({"t": "req", "id": sent + i, "op": "cache", "cache_id": cache.cache_id})
                              for i in range(40))
            try:
                await asyncio.to_thread(c.send, frames)
            except OSError:
                break
            sent += 40
            await asyncio.sleep(0.005)
        await until(lambda: not link9.healthy, 5, "the link to break")
        assert "does not read" in str(link9.error)
    finally:
        c.close()
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_data_requests_outside_registered_memory_are_refused(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d)
    addr = srv.listen_address
    assert addr is not None and g is not None
    base = list(cache.tensor_addrs)
    tb = d.tensor_bytes
    before = g.buf.copy()
    refused = {  # answered with an error code; the link stays
        "below": [(base[0] - 1, 2)],
        "past_end": [(base[0] + tb - 8, 9)],
        "guard_between": [(base[0] + tb, 16)],
        "zero_len": [(base[0], 0), (base[0], 8)],
        "wrap": [(2**64 - 8, 16)],
        "lengths_wrap": [(base[0], 2**64 - 8), (base[0], 16)],  # the sum wraps to 8
        "mixed": [(base[0], 8), (base[1] + tb, 8)],
    }

    def probe() -> dict[str, Any]:
        c = RawClient(addr)
        out: dict[str, Any] = {}
        try:
            c.handshake(9, PEER)
            assert c.data is not None
            for i, (name, runs) in enumerate(refused.items()):
                total = sum(n for _, n in runs) % 2**64
                c.data.sendall(c.data_frame(tcp.READ_REQ, 100 + i, cache.cache_id, runs, total=total))
                out["read_" + name] = c.data_recv()
                c.data.sendall(c.data_frame(tcp.WRITE_REQ, 200 + i, cache.cache_id, runs, b"\xee" * total, total))
                out["write_" + name] = c.data_recv()
            c.data.sendall(c.data_frame(tcp.READ_REQ, 300, 999, [(base[0], 8)]))
            out["unknown_cache"] = c.data_recv()
            c.data.sendall(c.data_frame(tcp.READ_REQ, 301, cache.cache_id, [(base[1] + 8, 8)]))
            out["good"] = c.data_recv()
        finally:
            c.close()
        return out

    def violate(frame: bytes) -> tuple[Any, bool]:
        c = RawClient(addr)
        try:
            c.handshake(10, PEER)
            assert c.data is not None
            c.data.sendall(frame)
            return c.data_recv(), c.closed_within(3.0)
        finally:
            c.close()

    out = await asyncio.to_thread(probe)
    for name in refused:
        for kind in ("read_", "write_"):
            frame = out[kind + name]
            assert frame is not None, kind + name
            (_k, _f, _r, _count, _req, code, total), payload = frame
            assert code == LLMStatusCode.LLM_PARAM_INVALID and total == 0 and payload == b"", (kind + name, frame)
    assert out["unknown_cache"][0][5] == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert out["good"][0][5] == 0 and out["good"][1] == g.tensors[1][8:16].tobytes()
    assert (g.buf == before).all(), "a refused request changed registered memory or its guards"
    await until(lambda: not inspect.links(srv)[9].healthy, 5, "the probing client's link to go")

    for frame in (tcp.HDR.pack(tcp.READ_REQ, 0, 0, tcp.MAX_RUNS + 1, 1, cache.cache_id, 8),  # too many runs
                  tcp.HDR.pack(tcp.READ_REQ, 0, 0, 0, 1, cache.cache_id, 0),  # no runs
                  tcp.HDR.pack(tcp.READ_REQ, 0, 0, 1, 1, cache.cache_id, tcp.MAX_FRAME_BYTES + 1),  # too big
                  tcp.HDR.pack(tcp.READ_RSP, 0, 0, 0, 77, 0, 8),  # answer to nothing
                  tcp.HDR.pack(9, 0, 0, 0, 1, 0, 0)):  # unknown kind
        answer, closed = await asyncio.to_thread(violate, frame)
        assert answer is None and closed, frame
        assert not inspect.links(srv)[10].healthy
        assert "protocol error" in str(inspect.links(srv)[10].error)
    assert (g.buf == before).all()
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_peer_exceeding_outstanding_requests_loses_the_link(cleanup: list[Any]) -> None:
    d = desc(4, 1 << 20, tensors=1)
    srv, g, cache = await server(cleanup, d)
    addr = srv.listen_address
    assert addr is not None and g is not None
    base = cache.tensor_addrs[0]

    c = RawClient(addr)

    def greedy() -> int:
        c.handshake(9, PEER)
        assert c.data is not None
        c.data.settimeout(10)  # a server that stopped reading without breaking the link fails the test
        n = 0
        for i in range(tcp.MAX_OUTSTANDING_FRAMES + 64):  # 1 MiB reads, never reading the answers
            try:
                c.data.sendall(c.data_frame(tcp.READ_REQ, i + 1, cache.cache_id, [(base, 1 << 20)]))
            except OSError:
                break
            n += 1
        return n

    try:  # open until the server has judged the link: a close before that breaks it as a failed send
        await asyncio.to_thread(greedy)
        await until(lambda: 9 not in inspect.links(srv) or not inspect.links(srv)[9].healthy, 5,
                    "the greedy link to break")
    finally:
        c.close()
    assert "outstanding" in str(inspect.links(srv)[9].error)
    local = inspect.local_cache(srv, cache.cache_id)
    assert local.inflight == 0 and not local.pins
    await serves_a_real_client(srv, cache, g, cleanup)


# ---------------------------------------------------------------------------------------- authentication
@pytest.mark.asyncio
async def test_auth_key_required_and_mutual(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    key = {"kvflow.AuthKey": "s3cret-s3cret-s3cret"}
    srv, g, cache = await server(cleanup, d, **key)
    addr = srv.listen_address
    assert addr is not None and g is not None

    async def try_link(cluster: int, **opts: str) -> LLMStatusCode:
        dd = await make_dd(cluster, **opts)
        try:
            return await link(dd, PEER, addr)
        finally:
            await dd.finalize()

    assert await try_link(20) == LLMStatusCode.LLM_LINK_FAILED  # no key
    assert await try_link(21, **{"kvflow.AuthKey": "another-secret-another"}) == LLMStatusCode.LLM_LINK_FAILED
    assert PEER not in inspect.links(srv) and not any(k in inspect.links(srv) for k in (20, 21))

    def raw_without_key() -> list[Any]:
        c = RawClient(addr)
        try:
            got = [c.hello(22, PEER)]
            c.send_msg({"t": "auth", "mac": b"\0" * 32})
            got.append(c.recv_msg())
            got.append(c.recv_msg())
            return got
        finally:
            c.close()

    challenge, answer, after = await asyncio.to_thread(raw_without_key)
    assert challenge is not None and set(challenge) == {"t", "nonce"}  # nothing about us, our caches or a token
    assert answer is not None and answer["t"] == "reject" and answer["code"] == LLMStatusCode.LLM_LINK_FAILED
    assert after is None  # and closed
    # a peer without the key is not served by a client that has one (mutual authentication)
    open_srv = await make_dd(30, listen=True)
    cleanup.append(open_srv)
    assert open_srv.listen_address is not None
    dd = await make_dd(23, **key)
    cleanup.append(dd)
    assert await link(dd, 30, open_srv.listen_address) == LLMStatusCode.LLM_LINK_FAILED
    assert not inspect.links(open_srv)
    # with the key: linked, and data moves
    assert await link(dd, PEER, addr) == LLMStatusCode.LLM_SUCCESS
    dst = Guarded(d, None)
    mine = await dd.register_kv_cache(d, dst.tensors)
    await dd.pull_kv_blocks(CacheIndex(PEER, cache.cache_id), mine, [0, 1, 2, 3], [0, 1, 2, 3])
    assert dst.crcs() == g.crcs()


# ---------------------------------------------------------------------------------------- limits
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_hundreds_of_links_from_one_process(cleanup: list[Any]) -> None:
    n = int(os.environ.get("KVFLOW_MANY_LINKS", "300"))
    first = 1000
    proc = PeerProcess(many_main)
    cleanup.append(proc)
    proc.send({"n": n, "first": first, "options": TCP})
    servers = await proc.recv(120)
    dd = await make_dd(5)
    cleanup.append(dd)
    d = CacheDesc(1, DataType.DT_UINT8, [4, 4096])
    dst = Guarded(CacheDesc(1, DataType.DT_UINT8, [n, 4096]), None)
    mine = await dd.register_kv_cache(dst.desc, dst.tensors)
    rss0 = _rss()
    t0 = time.monotonic()
    clusters = [ClusterInfo(first + i, [IpInfo(*servers[i][0])]) for i in range(n)]
    chunks = [clusters[i:i + 16] for i in range(0, n, 16)]
    rets = await asyncio.gather(*(dd.link_llm_clusters(c, 20000) for c in chunks))
    link_s = time.monotonic() - t0
    assert all(r == LLMStatusCode.LLM_SUCCESS for ret in rets for r in ret)
    assert len(inspect.links(dd)) == n
    t1 = time.monotonic()
    await asyncio.gather(*(dd.pull_kv_blocks(CacheIndex(first + i, servers[i][1]), mine, [i % 4], [i])
                           for i in range(n)))
    pull_s = time.monotonic() - t1
    for i in range(n):
        assert (dst.tensors[0][i * 4096:(i + 1) * 4096] == expected(first + i, d, 0, [i % 4])).all(), i
    per_link = (_rss() - rss0) / n
    await asyncio.sleep(1.2)  # a few heartbeat rounds over every link
    assert all(link.healthy for link in inspect.links(dd).values())
    rets = await asyncio.gather(*(dd.unlink_llm_clusters(c, 5000) for c in chunks))
    assert all(r == LLMStatusCode.LLM_SUCCESS for ret in rets for r in ret)
    assert not inspect.links(dd)
    proc.send("count")
    counts = await proc.recv(30)
    assert sum(counts.values()) == 0, "the servers dropped their side of every link"
    print(f"{n} links: linked in {link_s:.2f} s, one pull each in {pull_s:.2f} s, "
          f"~{per_link / 1024:.0f} KiB RSS per link")
    assert per_link < 256 << 10, f"{per_link / 1024:.0f} KiB per link"


@pytest.mark.asyncio
async def test_connection_flood_beyond_the_bound_is_reset_at_once(cleanup: list[Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import kvflow._listener as listener

    monkeypatch.setattr(listener, "MAX_CONNECTIONS", 8)
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d, **{"kvflow.HeartbeatInterval": "100",
                                                "kvflow.HeartbeatTimeout": "5000"})  # silent ones kept 5 s
    addr = srv.listen_address
    assert addr is not None and g is not None

    def flood() -> tuple[int, float]:
        socks: list[socket.socket] = []
        reset = 0
        t0 = time.monotonic()
        try:
            for _ in range(20):
                try:
                    socks.append(socket.create_connection(addr, timeout=3))
                except ConnectionResetError:  # reset before connect() returned
                    reset += 1
            for s in socks:
                s.settimeout(0.05)
                try:
                    s.recv(1)
                except ConnectionResetError:
                    reset += 1
                except TimeoutError:
                    pass
            return reset, time.monotonic() - t0
        finally:
            for s in socks:
                s.close()

    reset, took = await asyncio.to_thread(flood)
    assert reset >= 12 and took < 3.0, (reset, took)  # the silent ones beyond 8, reset long before 5 s
    await until(lambda: inspect.handshakes(srv) == 0, 10, "the silent handshakes to time out")
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_max_links_makes_room_by_dropping_broken_links(cleanup: list[Any]) -> None:
    d = desc(4, 4096)
    srv, g, _cache = await server(cleanup, d, **{"kvflow.MaxLinks": "2"})
    addr = srv.listen_address
    assert addr is not None and g is not None
    a, b, c = await make_dd(11), await make_dd(12), await make_dd(13)
    cleanup.extend([a, b, c])
    assert await link(a, PEER, addr) == LLMStatusCode.LLM_SUCCESS
    assert await link(b, PEER, addr) == LLMStatusCode.LLM_SUCCESS
    assert await link(c, PEER, addr) == LLMStatusCode.LLM_LINK_FAILED  # full
    await a.unlink_llm_clusters([ClusterInfo(PEER, [IpInfo(*addr)])], force=True)  # only a's side: srv's breaks
    await until(lambda: not inspect.links(srv)[11].healthy, 5, "the server to see the cut")
    assert set(inspect.links(srv)) == {11, 12}
    assert await link(c, PEER, addr) == LLMStatusCode.LLM_SUCCESS  # room made by dropping the broken link
    assert set(inspect.links(srv)) == {12, 13}
    assert inspect.links(srv)[12].healthy
