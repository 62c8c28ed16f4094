"""Lifecycle, options, links and their statuses, deadlines (SIGSTOP), registration."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from kvflow import (
    CacheDesc,
    ClusterInfo,
    DataType,
    IpInfo,
    LLMClusterNumExceedLimit,
    LlmDataDist,
    LLMException,
    LLMFailed,
    LLMParamInvalid,
    LlmRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from kvflow._tcp import TcpTransport

from .conftest import DESC, LOCAL_CLUSTER, PEER_CLUSTER, Pair, make_local, start_peer

pytestmark = pytest.mark.asyncio


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_initialize_twice_and_context_manager() -> None:
    async with LlmDataDist(5, LlmRole.MIX, options={"llm.ListenIpInfo": "127.0.0.1:0"}) as dd:
        addr = dd.listen_address
        assert addr is not None and addr[0] == "127.0.0.1" and addr[1] > 0
        await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0"})  # a no-op, as in LLM-DataDist
        assert dd.listen_address == addr
    assert dd.listen_address is None
    with pytest.raises(LLMException):
        await dd.register_kv_cache(DESC, [np.zeros(DESC.tensor_bytes, np.uint8)] * 4)


async def test_client_only_has_no_listen_address() -> None:
    async with LlmDataDist(6, LlmRole.DECODER) as dd:
        assert dd.listen_address is None


@pytest.mark.parametrize(("key", "value"), [
    ("llm.Bogus", "1"),
    ("llm.ListenIpInfo", "localhost"),
    ("llm.ListenIpInfo", "127.0.0.1:99999"),
    ("llm.SyncKvCacheWaitTime", "soon"),
    ("llm.SyncKvCacheWaitTime", "0"),
    ("kvflow.Transports", ""),
    ("kvflow.Transports", "tcp,tcp"),
    ("kvflow.HeartbeatInterval", "-5"),
])
async def test_bad_options_name_the_key(key: str, value: str) -> None:
    dd = LlmDataDist(7)
    with pytest.raises(LLMParamInvalid) as err:
        await dd.initialize({key: value})
    assert key in str(err.value)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("key", ["kvflow.tcp.NativePum", "kvflow.tcp.threads", "kvflow.tcp."])
async def test_misspelt_transport_option_is_refused_with_the_keys_it_reads(key: str) -> None:
    dd = LlmDataDist(7)
    with pytest.raises(LLMParamInvalid) as err:
        await dd.initialize({"kvflow.Transports": "tcp", key: "1"})
    assert repr(key) in str(err.value) and "kvflow.tcp.NativePump" in str(err.value)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


async def test_tcp_reads_exactly_the_options_docs_api_lists_and_accepts_them() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    listed = set(re.findall(r"`kvflow\.tcp\.(\w+)`", doc))
    assert listed == TcpTransport.option_keys
    good = {"BusyPollUs": "100", "InlinePollUs": "50", "NativePump": "0", "ThreadBytes": "65536", "Threads": "2"}
    async with LlmDataDist(7, options={"kvflow.Transports": "tcp",
                                       **{f"kvflow.tcp.{k}": v for k, v in good.items()}}) as dd:
        assert dd.transports == ("tcp",)


async def test_pinned_unknown_transport_is_feature_not_enabled() -> None:
    dd = LlmDataDist(8)
    with pytest.raises(LLMException) as err:
        await dd.initialize({"kvflow.Transports": "carrier_pigeon"})
    assert err.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


async def test_listen_on_busy_port_is_param_invalid() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        dd = LlmDataDist(9)
        with pytest.raises(LLMParamInvalid, match=r"llm\.ListenIpInfo"):
            await dd.initialize({"llm.ListenIpInfo": f"127.0.0.1:{s.getsockname()[1]}"})


async def test_register_checks_and_ids() -> None:
    async with LlmDataDist(10) as dd:
        arrs = [np.zeros(DESC.tensor_bytes, np.uint8) for _ in range(4)]
        a = await dd.register_kv_cache(DESC, arrs)
        b = await dd.register_kv_cache(DESC, [int(x.ctypes.data) for x in arrs])  # raw addresses, as in the seed
        assert a.cache_id == 1 and b.cache_id == 2
        assert a.tensor_addrs == b.tensor_addrs
        bad = [
            (DESC, arrs[:3]),                                            # wrong count
            (DESC, [np.zeros(DESC.tensor_bytes - 1, np.uint8)] * 4),     # too small
            (DESC, [0, 1, 2, 3]),                                        # null address
            (DESC, [b"x" * DESC.tensor_bytes] * 4),                      # read-only
            (DESC, ["nope"] * 4),                                        # not memory
            (CacheDesc(0, DataType.DT_INT32, [8, 16]), []),              # no tensors
            (CacheDesc(1, DataType.DT_INT32, [0, 16]), arrs[:1]),        # empty dimension
            (CacheDesc(1, DataType.DT_INT32, [8, 16], Placement.DEVICE), arrs[:1]),  # host buffer as device
        ]
        for desc, addrs in bad:
            with pytest.raises(LLMParamInvalid):
                await dd.register_kv_cache(desc, addrs)
        await dd.unregister_kv_cache(a.cache_id)
        await dd.unregister_kv_cache(a.cache_id)  # unknown ids succeed, as in LLM-DataDist
        await dd.unregister_kv_cache(12345)


async def test_link_statuses(pair: Pair) -> None:
    info = ClusterInfo(PEER_CLUSTER, [IpInfo(*pair.peer.address)])
    assert await pair.dd.link_llm_clusters([info]) == [LLMStatusCode.LLM_ALREADY_LINK]
    nobody = ClusterInfo(42, [IpInfo("127.0.0.1", _closed_port())])
    wrong_id = ClusterInfo(43, [IpInfo(*pair.peer.address)])  # the peer there is cluster 1, not 43
    t0 = time.monotonic()
    rets = await pair.dd.link_llm_clusters([nobody, wrong_id], timeout_in_millis=2000)
    assert rets == [LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_LINK_FAILED]
    assert time.monotonic() - t0 < 2.5
    with pytest.raises(LLMClusterNumExceedLimit) as err:
        await pair.dd.link_llm_clusters([ClusterInfo(100 + i, [IpInfo("127.0.0.1", 1)]) for i in range(17)])
    assert err.value.status_code == LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    with pytest.raises(LLMClusterNumExceedLimit):
        await pair.dd.unlink_llm_clusters([ClusterInfo(100 + i, []) for i in range(17)])
    with pytest.raises(LLMParamInvalid):
        await pair.dd.link_llm_clusters([info, info])


async def test_unlink_then_relink(pair: Pair) -> None:
    info = ClusterInfo(PEER_CLUSTER, [IpInfo(*pair.peer.address)])
    rid = await pair.peer.register(DESC, seed=1)
    cache, arrs = await pair.local_cache(DESC)
    assert await pair.dd.unlink_llm_clusters([info]) == [LLMStatusCode.LLM_SUCCESS]
    assert await pair.dd.unlink_llm_clusters([info]) == [LLMStatusCode.LLM_NOT_YET_LINK]
    for _ in range(100):  # the peer drops its side when told
        if LOCAL_CLUSTER not in await pair.peer.call("links"):
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("peer kept its side of the link after a non-force unlink")
    assert await pair.dd.link_llm_clusters([info]) == [LLMStatusCode.LLM_SUCCESS]
    await pair.dd.pull_kv_blocks(pair.index(rid), cache, [1], [1])
    assert arrs[0].any()
    assert await pair.dd.unlink_llm_clusters([info], force=True) == [LLMStatusCode.LLM_SUCCESS]
    assert await pair.dd.link_llm_clusters([info]) == [LLMStatusCode.LLM_SUCCESS]


async def test_link_timeout_against_silent_listener() -> None:
    """A listener that accepts and never answers: LLM_TIMEOUT (retryable) at the timeout, nothing hangs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        async with LlmDataDist(11) as dd:
            t0 = time.monotonic()
            rets = await dd.link_llm_clusters([ClusterInfo(12, [IpInfo(*s.getsockname())])], timeout_in_millis=300)
            assert rets == [LLMStatusCode.LLM_TIMEOUT]
            assert 0.29 < time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("transport", ["tcp"])
async def test_pull_from_stopped_peer_times_out_within_deadline(transport: str) -> None:
    peer = start_peer(transport)
    try:
        dd = await make_local(peer)  # heartbeats tolerate 10 s: the deadline, not liveness, must fire
        try:
            assert await dd.link_llm_clusters([ClusterInfo(PEER_CLUSTER, [IpInfo(*peer.address)])]) == [0]
            rid = await peer.register(DESC, seed=2)
            cache, _ = await Pair(dd, peer).local_cache(DESC)
            await dd.pull_kv_blocks(Pair(dd, peer).index(rid), cache, [0], [0])
            os.kill(peer.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(LLMTimeoutError) as err:
                    await dd.pull_kv_blocks(Pair(dd, peer).index(rid), cache, [1], [1], timeout_in_millis=500)
                took = time.monotonic() - t0
                assert isinstance(err.value, TimeoutError)
                assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
                assert 0.45 < took < 1.5, took
            finally:
                os.kill(peer.proc.pid, signal.SIGCONT)
            # the late answer is drained; the link still works once the peer runs again
            await dd.pull_kv_blocks(Pair(dd, peer).index(rid), cache, [2], [2], timeout_in_millis=5000)
        finally:
            await dd.finalize()
    finally:
        peer.proc.stop()


async def test_many_links_from_one_process() -> None:
    """One server, 40 clients linked at once (in one loop), each pulling once."""
    async with LlmDataDist(1000, options={"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": "tcp"}) as srv:
        buf = np.arange(DESC.tensor_bytes, dtype=np.uint8)
        rc = await srv.register_kv_cache(DESC, [buf] * 4)
        clients = [LlmDataDist(2000 + i) for i in range(40)]
        for c in clients:
            await c.initialize({"kvflow.Transports": "tcp"})
        try:
            rets = await asyncio.gather(*(c.link_llm_clusters([ClusterInfo(1000, [IpInfo(*srv.listen_address)])], 5000)
                                          for c in clients))
            assert all(r == [0] for r in rets)
            outs = []
            for c in clients:
                arrs = [np.zeros(DESC.tensor_bytes, np.uint8) for _ in range(4)]
                outs.append((await c.register_kv_cache(DESC, arrs), arrs))
            from kvflow import CacheIndex

            await asyncio.gather(*(c.pull_kv_blocks(CacheIndex(1000, rc.cache_id), cache, [3], [3])
                                   for c, (cache, _) in zip(clients, outs)))
            want = buf.reshape(DESC.num_blocks, DESC.stride)[3]
            assert all(np.array_equal(a[0].reshape(DESC.num_blocks, DESC.stride)[3], want) for _, a in outs)
        finally:
            for c in clients:
                await c.finalize()


@pytest.mark.asyncio
async def test_calls_after_finalize_say_finalized() -> None:
    dd = LlmDataDist(5, LlmRole.DECODER)
    with pytest.raises(LLMFailed, match="not initialized"):
        await dd.unregister_kv_cache(1)
    await dd.initialize({"kvflow.Transports": "tcp"})
    await dd.finalize()
    with pytest.raises(LLMFailed, match="was finalized"):
        await dd.unregister_kv_cache(1)
