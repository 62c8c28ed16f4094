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

from kvflow import (
    CacheDesc,
    CacheIndex,
    DataType,
    LlmDataDist,
    LLMException,
    LLMKvCacheNotExist,
    LLMStatusCode,
    Placement,
)


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


# ---------------------------------------------------------------------- hardware-bound (skipped where it is missing)
RDMA_ONLY = {"kvflow.ucx.TLS": "rc,self", "kvflow.ucx.RequireRdma": "yes"}  # UCX's RC verbs, even on one host


@pytest.mark.requires_rdma
@pytest.mark.requires_transport("ucx")
@pytest.mark.asyncio
@pytest.mark.kvflow_pair(desc=CacheDesc(4, DataType.DT_FLOAT16, [32, 16, 8, 128]), transport="ucx,tcp",
                         options=RDMA_ONLY)
async def test_fetch_and_push_over_rdma(kvflow_pair) -> None:
    # UCX may use only its RDMA transport, and kvflow takes ucx only if both sides have RDMA:
    # linked over ucx, every byte below moved by RDMA. tcp is there to learn why ucx was refused.
    if kvflow_pair.transport != "ucx":
        why = kvflow_pair.dd.link_info(kvflow_pair.remote_cluster_id).fallbacks.get("ucx", "?")
        if "no RDMA transport" in why:  # e.g. the libucx-cu12 wheel, built without verbs
            pytest.skip(f"this UCX build has no RDMA transport ({why}); build kvflow-ucx against a UCX "
                        "with verbs (KVFLOW_UCX_PREFIX, docs/ucx.md)")
        pytest.fail(f"linked over {kvflow_pair.transport}, not ucx: {why}")
    conn = MyConnector(kvflow_pair.dd, kvflow_pair.cache)
    wanted = [31, 5, 2, 7, 8, 9, 10, 0]
    got = await conn.fetch(kvflow_pair.remote, wanted)
    assert got == list(range(8))
    await kvflow_pair.remote_push_blocks([11, 12, 13], [20, 21, 22])  # and the prefill side pushes over RDMA
    remote = await kvflow_pair.remote_read()
    for local, rem in zip(kvflow_pair.local, remote):
        local_b, remote_b = kvflow_pair.blocks(local), kvflow_pair.blocks(rem)
        assert np.array_equal(local_b[got], remote_b[wanted])
        assert np.array_equal(local_b[[20, 21, 22]], remote_b[[11, 12, 13]])
        assert not local_b[8:20].any() and not local_b[23:].any()  # nothing else was written


@pytest.mark.requires_gpu
@pytest.mark.requires_transport("ucx")
@pytest.mark.asyncio
@pytest.mark.kvflow_pair(desc=CacheDesc(2, DataType.DT_FLOAT16, [16, 4, 8]), transport="ucx")
async def test_blocks_move_between_gpu_memory_and_the_prefill_worker(kvflow_pair) -> None:
    # the decode side's cache in CUDA memory (Placement.DEVICE); ucx moves device memory, shm and tcp do not
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed without a usable CUDA device")
    desc = kvflow_pair.desc
    dd, nb = kvflow_pair.dd, desc.num_blocks
    gpu_desc = CacheDesc(desc.num_tensors, desc.data_type, list(desc.shape), placement=Placement.DEVICE)
    gpu = [torch.zeros(tuple(desc.shape), dtype=torch.float16, device="cuda") for _ in range(desc.num_tensors)]
    cache = await dd.register_kv_cache(gpu_desc, gpu)

    def gpu_blocks(t: int) -> np.ndarray:  # one GPU tensor's bytes, copied to the host, as [blocks, bytes]
        return kvflow_pair.blocks(gpu[t].cpu().numpy().view(np.uint8).reshape(-1))

    try:
        # prefill blocks 5, 2, 7 into GPU blocks 0, 1, 2
        await dd.pull_kv_blocks(kvflow_pair.remote, cache, [5, 2, 7], [0, 1, 2])
        torch.cuda.synchronize()
        before = await kvflow_pair.remote_read()
        for t, rem in enumerate(before):
            got = gpu_blocks(t)
            assert np.array_equal(got[[0, 1, 2]], kvflow_pair.blocks(rem)[[5, 2, 7]])
            assert not got[3:].any()
        # new bytes in GPU blocks 3 and 4, pushed into the prefill's blocks 0 and 1
        rng = np.random.default_rng(5)
        for g in gpu:
            host = g.cpu().numpy()
            host.view(np.uint8).reshape(nb, -1)[3:5] = rng.integers(0, 256, (2, desc.stride), dtype=np.uint8)
            g.copy_(torch.from_numpy(host))
        torch.cuda.synchronize()
        await dd.push_kv_blocks(cache, kvflow_pair.remote, [3, 4], [0, 1])
        after = await kvflow_pair.remote_read()
        for t, (old, new) in enumerate(zip(before, after)):
            new_b, old_b = kvflow_pair.blocks(new), kvflow_pair.blocks(old)
            assert np.array_equal(new_b[[0, 1]], gpu_blocks(t)[[3, 4]])
            assert np.array_equal(new_b[2:], old_b[2:])  # nothing else was written
    finally:
        await dd.unregister_kv_cache(cache.cache_id)
