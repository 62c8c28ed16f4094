"""What a serving framework's own test suite looks like with kvflow's pytest plugin.

Nothing here imports kvflow's test helpers or writes a conftest: the fixtures come from the
plugin that ``pip install kvflow`` registers (``pytest11`` entry point). ``MyConnector`` stands
in for the user's code: a decode worker that fetches a request's KV blocks from prefill.

Run it alone with ``python -m pytest examples/user_suite``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvflow import CacheDesc, CacheIndex, DataType, LlmDataDist, LLMException, LLMKvCacheNotExist, LLMStatusCode


class MyConnector:
    """The user's code under test: fetch a request's blocks into free local blocks, with a retry."""

    def __init__(self, dd: LlmDataDist, cache, retries: int = 2, timeout_ms: int = 2000) -> None:
        self.dd, self.cache, self.retries, self.timeout_ms = dd, cache, retries, timeout_ms
        self.free = list(range(cache.cache_desc.shape[0]))

    async def fetch(self, remote: CacheIndex, remote_blocks: list[int]) -> list[int]:
        mine = [self.free.pop(0) for _ in remote_blocks]
        for attempt in range(self.retries + 1):
            try:
                await self.dd.pull_kv_blocks(remote, self.cache, remote_blocks, mine, timeout_in_millis=self.timeout_ms)
                return mine
            except LLMException as exc:
                if exc.status_code not in (LLMStatusCode.LLM_TIMEOUT,) or attempt == self.retries:
                    self.free[:0] = mine
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_fetch_copies_exactly_the_requested_blocks(kvflow_pair) -> None:
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache)
    got = await conn.fetch(kvflow_pair.remote, [5, 2, 7])
    assert got == [0, 1, 2]
    remote = await kvflow_pair.remote_read()
    for local, rem in zip(kvflow_pair.local, remote):
        local_b, remote_b = kvflow_pair.blocks(local), kvflow_pair.blocks(rem)
        assert np.array_equal(local_b[[0, 1, 2]], remote_b[[5, 2, 7]])
        assert not local_b[3:].any()  # nothing else was written


@pytest.mark.asyncio
async def test_prefill_pushes_and_the_connector_sees_it(kvflow_pair) -> None:
    # the prefill side (another process) pushes blocks 0..3 into our blocks 4..7
    await kvflow_pair.remote_push_blocks([0, 1, 2, 3], [4, 5, 6, 7])
    remote = await kvflow_pair.remote_read()
    for local, rem in zip(kvflow_pair.local, remote):
        assert np.array_equal(kvflow_pair.blocks(local)[4:], kvflow_pair.blocks(rem)[:4])


@pytest.mark.asyncio
async def test_missing_cache_is_a_typed_error_and_frees_the_blocks(kvflow_pair) -> None:
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache)
    gone = CacheIndex(kvflow_pair.remote_cluster_id, 999)
    with pytest.raises(LLMKvCacheNotExist):
        await conn.fetch(gone, [0])
    assert conn.free[0] == 0
    assert kvflow_pair.dd.link_info(kvflow_pair.remote_cluster_id).state == "linked"


@pytest.mark.asyncio
@pytest.mark.kvflow_pair(desc=CacheDesc(2, DataType.DT_FLOAT16, [16, 4, 8]), transport="tcp", proxy=True)
async def test_a_stalled_link_times_out_then_recovers(kvflow_pair) -> None:
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache, retries=0, timeout_ms=300)
    # connection 0 is the link's control connection (heartbeats), 1 its data connection
    kvflow_pair.proxy.stall(conns=[1])
    with pytest.raises(TimeoutError):  # LLMTimeoutError is also a builtin TimeoutError
        await conn.fetch(kvflow_pair.remote, [1])
    kvflow_pair.proxy.resume()
    conn.timeout_ms = 10_000
    assert await conn.fetch(kvflow_pair.remote, [1]) == [0]  # the link survived the timeout
    errors = kvflow_pair.dd.stats()["ops"]["pull"]["errors"]
    assert errors == {"LLM_TIMEOUT": 1}


@pytest.mark.asyncio
async def test_a_dead_prefill_worker_fails_fast_and_typed(kvflow_pair) -> None:
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache, retries=0, timeout_ms=10_000)
    kvflow_pair.kill_remote()  # SIGKILL: its sockets close, the link breaks
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(LLMException) as err:
        await conn.fetch(kvflow_pair.remote, [0])
    assert err.value.status_code in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK)
    assert asyncio.get_running_loop().time() - t0 < 5.0  # not the 10 s deadline: the link broke at once
    assert conn.free[0] == 0  # the connector gave its blocks back


@pytest.mark.asyncio
async def test_counters_match_what_the_connector_moved(kvflow_pair) -> None:
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache)
    await conn.fetch(kvflow_pair.remote, [0, 1, 2, 3])
    pulls = kvflow_pair.dd.stats()["ops"]["pull"]
    assert pulls["transfers"] == 1
    assert pulls["bytes"] == 4 * kvflow_pair.desc.stride * kvflow_pair.desc.num_tensors


@pytest.mark.asyncio
async def test_my_fake_transport_would_pass_conformance(transport_conformance) -> None:
    # a transport plugin's author points this at their own entry-point name
    await transport_conformance("tcp", timeout=120)


@pytest.mark.requires_rdma
def test_only_on_rdma_machines() -> None:
    raise AssertionError("runs only where an RDMA port is ACTIVE")


@pytest.mark.requires_gpu
def test_only_on_gpu_machines() -> None:
    raise AssertionError("runs only where a CUDA GPU is present")
