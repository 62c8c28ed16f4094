"""Timeouts over ucx do not break the link (issue 11), with the peer in another process.

A stalled peer (SIGSTOP) holds the gets and puts that UCX emulates with messages over TCP until it
resumes; UCX cannot retract them (``ucp_request_cancel`` cancels only tag receives). A transfer
that passes its deadline waits ``CANCEL_SETTLE_S`` for them, then replaces the UCP endpoint
(force-closing the old one completes them as cancelled) and raises the timeout; the link stays
up, and the peer's own endpoint to us is untouched. Over shared memory UCX moves the bytes itself
(CMA), so a stopped peer does not hold a transfer at all. See docs/ucx.md, "Cancellation and
deadlines".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import kvflow.testing
import numpy as np
import pytest
from kvflow import CacheDesc, DataType, LlmDataDist, LLMTimeoutError
from kvflow._compat import timeout as timeout_after
from kvflow.testing import KvPair, PairConfig, open_pair, pattern
from ucx_testlib import TLS_PARAMS, requires_ucx

from kvflow_ucx import UcxEndpoint

pytestmark = requires_ucx

BLOCKS = 128
DESC = CacheDesc(2, DataType.DT_UINT8, [BLOCKS, 256 << 10])  # 2 tensors x 32 MiB
TIMEOUT_MS = 500
#: How far past its deadline a timed-out transfer may raise. Measured here: 52-54 ms over TCP with
#: the peer stopped (CANCEL_SETTLE_S, 50 ms, plus the reset), under 8 ms with the peer running; the
#: rest is slack for a loaded 2-core machine.
OVERRUN_BOUND_S = 0.35


@contextlib.asynccontextmanager
async def _pair(tls: str) -> AsyncIterator[KvPair]:
    # A long heartbeat timeout: this tests what the ucx endpoint does, not heartbeat silence
    # (the peer is stopped for under a second; the default 2 s would not fire either).
    pair = await open_pair(PairConfig(desc=DESC, transport="ucx",
                                      options={"kvflow.ucx.TLS": tls, "kvflow.HeartbeatTimeout": "10000"}))
    try:
        async with timeout_after(60):
            yield pair
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pair.peer.pid, signal.SIGCONT)
        await pair.close()


def _endpoint(dd: LlmDataDist, cluster_id: int) -> UcxEndpoint:
    """The ucx endpoint of the link to ``cluster_id``."""
    endpoint = kvflow.testing.inspect.link(dd, cluster_id).endpoint
    assert isinstance(endpoint, UcxEndpoint), endpoint
    return endpoint


def _blocks(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(BLOCKS, -1)


def _want(t: int) -> np.ndarray:
    """The peer's tensor ``t`` (PairConfig.remote_fill = 1000)."""
    return pattern(1000 + t, DESC.tensor_bytes)


async def _until_inflight(pair: KvPair) -> None:
    endpoint = _endpoint(pair.dd, pair.remote_cluster_id)
    for _ in range(10_000):
        if endpoint._inflight:
            return
        await asyncio.sleep(0)
    raise AssertionError("no transfer was in flight")


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", TLS_PARAMS)
async def test_timeout_on_a_stopped_peer_keeps_the_link(tls: str) -> None:
    """Peer SIGSTOPped mid-pull: the pull raises LLMTimeoutError within OVERRUN_BOUND_S of its
    deadline; after SIGCONT the same link moves every block, both ways, every byte checked."""
    async with _pair(tls) as pair:
        dd, cid, every = pair.dd, pair.remote_cluster_id, list(range(BLOCKS))
        await dd.pull_kv_blocks(pair.remote, pair.cache, every, every)  # wired up, description cached
        endpoint = _endpoint(dd, cid)
        for t in pair.local:
            t[:] = 0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.ensure_future(
            dd.pull_kv_blocks(pair.remote, pair.cache, every, every, timeout_in_millis=TIMEOUT_MS))
        await _until_inflight(pair)
        os.kill(pair.peer.pid, signal.SIGSTOP)
        try:
            await task
        except LLMTimeoutError:
            took = loop.time() - t0
            print(f"\n[{tls}] pull from a stopped peer: LLMTimeoutError after {took * 1000:.0f} ms "
                  f"(deadline {TIMEOUT_MS} ms), endpoint resets {endpoint.resets}")
            assert TIMEOUT_MS / 1000 <= took < TIMEOUT_MS / 1000 + OVERRUN_BOUND_S, took
            assert isinstance(task.exception(), TimeoutError)
        else:  # over shared memory UCX reads the stopped peer's memory itself (CMA)
            assert tls != "tcp", "a pull over UCX's TCP finished although the peer was stopped"
            print(f"\n[{tls}] pull from a stopped peer completed (CMA needs no peer CPU)")
        if tls == "tcp":
            assert endpoint.resets == 1
        assert dd.link_info(cid).state == "linked"
        for t in range(2):  # an abandoned pull leaves each byte old (0) or the peer's, nothing else
            assert ((pair.local[t] == 0) | (pair.local[t] == _want(t))).all()
        os.kill(pair.peer.pid, signal.SIGCONT)

        for t in pair.local:
            t[:] = 0
        await dd.pull_kv_blocks(pair.remote, pair.cache, every, every[::-1])
        assert dd.link_info(cid).state == "linked"
        assert _endpoint(dd, cid) is endpoint
        for t in range(2):
            assert np.array_equal(_blocks(pair.local[t]), _blocks(_want(t))[::-1])
        # the peer's side of the link works too: its endpoint to us was not touched
        await pair.remote_push_blocks([5, 6], [0, 1])
        for t in range(2):
            assert np.array_equal(_blocks(pair.local[t])[:2], _blocks(_want(t))[5:7])
        await pair.remote_pull_blocks([2, 3], [9, 10])
        remote = await pair.remote_read()
        for t in range(2):
            assert np.array_equal(_blocks(remote[t])[9:11], _blocks(pair.local[t])[2:4])
        assert (await pair.call("links")) == {pair.local_cluster_id: "linked"}


@pytest.mark.asyncio
async def test_a_timed_out_push_does_not_fail_the_pull_beside_it() -> None:
    """Over TCP: a push with a short deadline is in flight when the peer stops; a pull with a long one
    is issued after. The push times out and resets the endpoint under the pull, which issues again
    on the new endpoint and completes once the peer resumes. The abandoned push leaves each of the
    peer's bytes old or pushed."""
    async with _pair("tcp") as pair:
        dd, cid, half = pair.dd, pair.remote_cluster_id, BLOCKS // 2
        await dd.pull_kv_blocks(pair.remote, pair.cache, [0], [0])
        endpoint = _endpoint(dd, cid)
        for t in range(2):
            pair.local[t][:] = pattern(7 + t, DESC.tensor_bytes)
        src = [a.copy() for a in pair.local]
        first, second = list(range(half)), list(range(half, BLOCKS))
        t0 = time.monotonic()
        push = asyncio.ensure_future(dd.push_kv_blocks(pair.cache, pair.remote, first, first,
                                                       timeout_in_millis=400))
        await _until_inflight(pair)
        os.kill(pair.peer.pid, signal.SIGSTOP)
        pull = asyncio.ensure_future(dd.pull_kv_blocks(pair.remote, pair.cache, second, second,
                                                       timeout_in_millis=20_000))
        with pytest.raises(LLMTimeoutError):
            await push
        took = time.monotonic() - t0
        print(f"\n[tcp] push to a stopped peer: LLMTimeoutError after {took * 1000:.0f} ms (deadline 400 ms)")
        assert took < 0.4 + OVERRUN_BOUND_S, took
        assert endpoint.resets == 1
        assert dd.link_info(cid).state == "linked"
        assert not pull.done()
        os.kill(pair.peer.pid, signal.SIGCONT)
        await pull
        for t in range(2):
            assert np.array_equal(_blocks(pair.local[t])[half:], _blocks(_want(t))[half:])
        remote = await pair.remote_read()
        for t in range(2):
            got = _blocks(remote[t])[:half]
            assert ((got == _blocks(_want(t))[:half]) | (got == _blocks(src[t])[:half])).all()
        await dd.push_kv_blocks(pair.cache, pair.remote, first, first)
        remote = await pair.remote_read()
        for t in range(2):
            assert np.array_equal(_blocks(remote[t])[:half], _blocks(src[t])[:half])
        assert endpoint.resets == 1
        assert dd.link_info(cid).state == "linked"


@pytest.mark.asyncio
@pytest.mark.parametrize("tls,deadline_ms", [pytest.param("tcp", 10, id="tcp"),
                                             pytest.param("sm", 3, id="sm")])
async def test_cancelled_transfers_with_a_live_peer_drain_in_place(tls: str, deadline_ms: int) -> None:
    """A running peer: pulls cut short by their deadline wait for their issued operations (a window,
    milliseconds) and raise; the endpoint is reset only when that takes over CANCEL_SETTLE_S."""
    async with _pair(tls) as pair:
        dd, cid, every = pair.dd, pair.remote_cluster_id, list(range(BLOCKS))
        await dd.pull_kv_blocks(pair.remote, pair.cache, every, every)
        endpoint = _endpoint(dd, cid)
        loop = asyncio.get_running_loop()
        over: list[float] = []
        for _ in range(10):
            t0 = loop.time()
            try:
                await dd.pull_kv_blocks(pair.remote, pair.cache, every, every, timeout_in_millis=deadline_ms)
            except LLMTimeoutError:
                over.append(loop.time() - t0 - deadline_ms / 1000)
        over.sort()
        resets = endpoint.resets
        print(f"\n[{tls}] {len(over)}/10 pulls of {DESC.tensor_bytes * 2 >> 20} MiB cut at {deadline_ms} ms: "
              f"raised {over[0] * 1000:.1f} / {over[len(over) // 2] * 1000:.1f} / {over[-1] * 1000:.1f} ms "
              f"(min / median / max) past the deadline; endpoint resets {resets}")
        assert len(over) >= 5
        assert over[-1] < OVERRUN_BOUND_S
        assert resets <= 2  # a reset only when this machine stalled the drain past CANCEL_SETTLE_S
        assert dd.link_info(cid).state == "linked"
        for t in pair.local:
            t[:] = 0
        await dd.pull_kv_blocks(pair.remote, pair.cache, every, every)
        for t in range(2):
            assert np.array_equal(pair.local[t], _want(t))
