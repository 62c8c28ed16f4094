"""A plan too large for one batch reaches the transport in batches of at most its ``max_runs``.

Each batch that a transport's ``read`` / ``write`` finishes wakes the caller's loop once, so the
core hands a transport that asks for it (shm, ucx: they check and copy a large batch off the loop)
batches of up to 65536 runs, and the others 8192. The real endpoint's ``read`` / ``write`` are
wrapped to record each batch's size; the bytes moved are checked against the peer's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvflow import CacheDesc, DataType
from kvflow._engine import MAX_BATCH_RUNS
from kvflow.testing import inspect
from kvflow.transport import RunBatch

from .conftest import PEER_CLUSTER, Pair

BLOCKS = 40_000  # scattered blocks of 16 bytes over 2 tensors: a plan of 80000 runs, kept as factors


def _record(ep: Any, sizes: list[int]) -> None:
    """Record the run count of each batch handed to ``ep``'s read and write."""
    for name in ("read", "write"):
        orig = getattr(ep, name)

        async def recorded(batch: RunBatch, _orig: Any = orig) -> None:
            sizes.append(len(batch))
            await _orig(batch)

        setattr(ep, name, recorded)


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("max_runs", [None, 1000], ids=["transport's own", "1000"])
async def test_a_large_plan_reaches_the_transport_in_batches_of_its_max_runs(pair: Pair, op: str,
                                                                             max_runs: int | None) -> None:
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[BLOCKS, 16])
    rid = await pair.peer.register(desc, 11)
    cache, local = await pair.local_cache(desc, seed=5)
    ep = inspect.links(pair.dd)[PEER_CLUSTER].endpoint
    assert ep is not None
    if max_runs is not None:
        ep.max_runs = max_runs  # type: ignore[misc]  # this endpoint only: the class keeps its own
    step = min(ep.max_runs, MAX_BATCH_RUNS)
    if max_runs is None:  # shm and ucx take the largest batches the core makes; tcp two batches in flight
        assert step == (MAX_BATCH_RUNS if pair.peer.transport in ("shm", "ucx") else 16384)  # are half its bound
    sizes: list[int] = []
    _record(ep, sizes)
    perm = [i * 7919 % BLOCKS for i in range(BLOCKS)]  # no two neighbours coalesce: one run per block
    ident = list(range(BLOCKS))
    if op == "pull":
        await pair.dd.pull_kv_blocks(pair.index(rid), cache, perm, ident, timeout_in_millis=60_000)
    else:
        await pair.dd.push_kv_blocks(cache, pair.index(rid), ident, perm, timeout_in_millis=60_000)
    assert sum(sizes) == 2 * BLOCKS
    assert sizes[:-1] == [step] * (len(sizes) - 1) and 0 < sizes[-1] <= step, (step, sizes)
    remote = await pair.peer.read(rid)
    for t in range(2):
        got, want = local[t].reshape(BLOCKS, -1), remote[t].reshape(BLOCKS, -1)
        assert np.array_equal(got[ident], want[perm]) if op == "pull" else np.array_equal(want[perm], got[ident])

