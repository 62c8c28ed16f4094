"""kvflow's transfers leave no cyclic garbage, on either side of a link.

Objects freed only by the cyclic garbage collector make its passes run often, and a pass runs inside
whichever callback allocates when the threshold is crossed: a gen-0 pass cost 0.3 ms here and a full
one 20-60 ms in a pytest process (docs/decisions.md, "The loop: hand-over and garbage"). Both sides
of the link live in this process so that ``gc.DEBUG_SAVEALL`` sees the serving side's objects too;
the bytes still cross real loopback sockets, shared memory or UCX.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
import pytest_asyncio

from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LayerEvents,
    LlmDataDist,
    LLMParamInvalid,
    LlmRole,
    LLMTimeoutError,
    TransferConfig,
)

from .conftest import API_VARIANTS, QUIET_HEARTBEAT, _api_transports

PROMPT, DECODER = 1, 2


@pytest_asyncio.fixture(params=_api_transports())
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LlmDataDist, LlmDataDist]]:
    transport, extra = API_VARIANTS[request.param]
    opts = {"kvflow.Transports": transport, **QUIET_HEARTBEAT, **extra}
    p = LlmDataDist(PROMPT, LlmRole.PROMPT)
    await p.initialize({"llm.ListenIpInfo": "127.0.0.1:0", **opts})
    d = LlmDataDist(DECODER, LlmRole.DECODER)
    try:
        await d.initialize(opts)
        assert await d.link_llm_clusters([ClusterInfo(PROMPT, [IpInfo(*p.listen_address)])], 5000) == [0]
        yield p, d
    finally:
        await d.finalize()
        await p.finalize()


def _garbage_of(ops: list[Callable[[], Awaitable[object]]]) -> Callable[[], Awaitable[collections.Counter[str]]]:
    async def run() -> collections.Counter[str]:
        for op in ops:  # the first run also looks the peer's cache up and starts worker threads
            await op()
        await asyncio.sleep(0.05)  # responses and hand-backs still on their way
        gc.collect()
        flags, before = gc.get_debug(), len(gc.garbage)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for op in ops:
                await op()
            await asyncio.sleep(0.05)
            gc.collect()
            return collections.Counter(type(o).__qualname__ for o in gc.garbage[before:])
        finally:
            gc.set_debug(flags)
            del gc.garbage[before:]
    return run


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_transfers_of_every_kind_leave_no_cyclic_garbage(pair: tuple[LlmDataDist, LlmDataDist]) -> None:
    p, d = pair
    desc = CacheDesc(num_tensors=4, data_type=DataType.DT_UINT8, shape=[4096, 4096])
    pc = await p.register_kv_cache(desc, [np.full(desc.tensor_bytes, t + 1, np.uint8) for t in range(4)])
    local = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(4)]
    dc = await d.register_kv_cache(desc, local)
    ci = CacheIndex(PROMPT, pc.cache_id)
    perm = np.random.default_rng(5).permutation(4096).tolist()
    ident = list(range(4096))

    async def bad_call() -> None:
        with pytest.raises(LLMParamInvalid):
            await d.pull_kv_blocks(ci, dc, [0, 1], [2, 2])

    async def cut_short() -> None:  # frames queued and in flight when the deadline passes
        with pytest.raises(LLMTimeoutError):
            await d.pull_kv_blocks(ci, dc, perm, ident, timeout_in_millis=1)
        await asyncio.sleep(0.2)  # the peer's late answers are drained

    async def layerwise() -> None:
        ready = LayerEvents(4)
        for layer in range(4):
            ready.mark_ready(layer)
        await d.transfer_cache_async(dc, ready, [TransferConfig(ci)], ident[:512], perm[:512],
                                     tensor_num_per_layer=1)

    ops: list[Callable[[], Awaitable[object]]] = [
        lambda: d.pull_kv_blocks(ci, dc, [7], [9]),  # the small fast path
        lambda: d.push_kv_blocks(dc, ci, [9], [7]),
        lambda: d.pull_kv_blocks(ci, dc, perm, ident),  # scattered, split into frames and worker copies
        lambda: d.push_kv_blocks(dc, ci, ident, perm),
        lambda: d.pull_kv_cache(ci, dc),  # whole slot: 64 MiB
        layerwise,
        bad_call,
        cut_short,
        lambda: d.pull_kv_cache(ci, dc),  # the link still works, and the bytes below are this pull's
    ]
    garbage = await _garbage_of(ops)()
    assert not garbage, f"objects left to the cyclic collector: {garbage.most_common(10)}"
    for t in range(4):  # the transfers ran: the last whole pull brought the peer's bytes
        assert (local[t] == t + 1).all()
