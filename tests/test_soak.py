"""Soak (issue 6): many random transfers through a fault-injecting proxy, every completed one verified.

A peer process (cluster 1) holds SRC (fixed contents, pulled from) and DST (pushed to); this
process holds LOCAL. Rounds of 1-4 concurrent transfers on disjoint blocks run through a
``FaultProxy`` that now and then stalls the data connection, cuts it (FIN or RST), truncates
it mid-frame or stalls everything until the heartbeat breaks the link; some calls are
cancelled after a random delay or given a deadline of a few milliseconds.

Checked:
- every completed pull: the destination blocks hold exactly the source blocks (crc32 per block);
- every completed push: the peer's blocks hold exactly what was pushed (read back from the peer
  process as the call returns, and again at checkpoints until a later push overwrites them);
- every failed pull: its destination blocks do not change after the call raised (checked at
  checkpoints, until a later transfer writes them);
- guards around every cache are intact; after a failure the link is made again and works;
- at the end nothing is pinned or outstanding on either side.

``KVFLOW_SOAK_N`` transfers (default 1000, well under a minute); ``KVFLOW_SOAK_SEED`` (default 1);
``KVFLOW_SOAK_OUT=path.json`` writes the counts. The figures in docs/reliability.md come from
``KVFLOW_SOAK_N=10000 python -m pytest tests/test_soak.py -s``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import zlib
from collections import Counter
from typing import Any

import pytest

from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMException,
    LLMKvCacheNotExist,
    LLMNotYetLink,
    LlmRole,
    LLMStatusCode,
    LLMTimeoutError,
)
from kvflow import _tcp as tcp
from kvflow.testing import FaultProxy, inspect

from ._relpeer import Guarded, Peer

N = int(os.environ.get("KVFLOW_SOAK_N", "1000"))
SEED = int(os.environ.get("KVFLOW_SOAK_SEED", "1"))
PEER, LOCAL = 1, 2
BLOCKS, BLOCK_BYTES, TENSORS = 64, 16 << 10, 2
DESC = CacheDesc(TENSORS, DataType.DT_UINT8, [BLOCKS, BLOCK_BYTES])
SPEC = (TENSORS, int(DataType.DT_UINT8), [BLOCKS, BLOCK_BYTES])
HB = {"kvflow.HeartbeatInterval": "100", "kvflow.HeartbeatTimeout": "500"}
FAULTS = {  # per round of transfers: the probability of each fault
    "stall_data": 0.02,  # the data connection stops (after some bytes) for 10-300 ms; calls wait it out
    "stall_deadline": 0.02,  # the same, but the calls have a 30 ms deadline: late bytes must be discarded
    "drop": 0.006, "reset": 0.006,  # every connection cut (FIN / RST): the link breaks, is made again
    "truncate": 0.006,  # the data connection cut after some bytes, mid-frame
    "stall_all": 0.002,  # everything stops for 0.8 s: the heartbeat (0.5 s) breaks the link
    "cancel": 0.03,  # the first call of the round is cancelled after 0-3 ms
    "deadline": 0.03,  # every call of the round has a 1-5 ms deadline
}


def _crcs(g: Guarded, blocks: list[int]) -> list[tuple[int, ...]]:
    s = DESC.stride
    return [tuple(zlib.crc32(t[b * s:(b + 1) * s]) for t in g.tensors) for b in blocks]


class Soak:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.counts: Counter[str] = Counter()
        self.local_state: dict[int, tuple[int, ...]] = {}  # block -> crcs it must hold now
        self.dst_state: dict[int, tuple[int, ...]] = {}  # peer DST block -> crcs it must hold
        self.src_crcs = _crcs(Guarded(DESC, 71), list(range(BLOCKS)))
        self.resume_at = 0.0
        self.quarantine: dict[int, tuple[int, ...]] = {}  # blocks of failed pulls, awaiting the late-byte check
        self.failed_now: dict[int, tuple[int, ...]] = {}
        self.verified_bytes = 0

    async def setup(self) -> None:
        self.peer = Peer(PEER, caches=[(*SPEC, 71), (*SPEC, None)], options={"kvflow.Transports": "tcp", **HB})
        self.src, self.dst = (CacheIndex(PEER, c) for c in self.peer.caches)
        self.proxy = await FaultProxy(self.peer.address).start()
        self.dd = LlmDataDist(LOCAL, LlmRole.DECODER)
        await self.dd.initialize({"kvflow.Transports": "tcp", "llm.SyncKvCacheWaitTime": "2000", **HB})
        self.local = Guarded(DESC, 72)
        self.cache = await self.dd.register_kv_cache(DESC, self.local.tensors)
        for b, crc in enumerate(_crcs(self.local, list(range(BLOCKS)))):
            self.local_state[b] = crc
        await self.relink()

    async def close(self) -> None:
        await self.dd.finalize()
        await self.proxy.close()
        self.peer.stop()

    async def relink(self) -> None:
        loop = asyncio.get_running_loop()
        if self.resume_at > loop.time():  # a stall of everything is still on: wait it out
            await asyncio.sleep(self.resume_at - loop.time())
        self.proxy.resume()
        for _ in range(100):
            ret = (await self.dd.link_llm_clusters([ClusterInfo(PEER, [IpInfo(*self.proxy.address)])], 2000))[0]
            if ret in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                self.data_conn = self.proxy.connections[-1].index  # the link's data connection
                if ret == LLMStatusCode.LLM_SUCCESS:
                    self.counts["relinks"] += 1
                return
            await asyncio.sleep(0.05)
        raise AssertionError("could not link again within 5 s")

    # ------------------------------------------------------------------ one round
    async def round(self) -> None:
        rng = self.rng
        k = rng.choice([1, 1, 2, 3, 4])
        local_free = [b for b in range(BLOCKS) if b not in self.quarantine]
        dst_free = list(range(BLOCKS))
        rng.shuffle(local_free)
        rng.shuffle(dst_free)
        ops = []
        for _ in range(k):
            n = min(rng.randint(1, 8), len(local_free))
            if n == 0:
                break
            lb, local_free = local_free[:n], local_free[n:]
            if rng.random() < 0.6:
                ops.append(("pull", rng.sample(range(BLOCKS), n), lb))
            else:
                db, dst_free = dst_free[:n], dst_free[n:]
                ops.append(("push", lb, db))
        fault = None
        r = rng.random()
        for name, p in FAULTS.items():
            if r < p:
                fault = name
                break
            r -= p
        if fault:
            self.counts["fault_" + fault] += 1
        tasks = [asyncio.ensure_future(self.transfer(op, fault if i == 0 or fault != "cancel" else None))
                 for i, op in enumerate(ops)]
        if fault in ("stall_data", "stall_deadline", "drop", "reset", "truncate", "stall_all"):
            await asyncio.sleep(rng.uniform(0, 0.003))
            self.inject(fault)
        results = await asyncio.gather(*tasks)
        broken = any(r is None for r in results)
        if any(results):  # a call issued after every quarantined failure completed: late bytes are all in
            for blk, crc in self.quarantine.items():
                assert _crcs(self.local, [blk])[0] == crc, f"a byte landed in block {blk} after its pull failed"
                self.counts["late_checks"] += 1
            self.quarantine.clear()
        self.quarantine.update(self.failed_now)
        self.failed_now.clear()
        if broken or not inspect.links(self.dd)[PEER].healthy:
            await self.relink()

    def inject(self, fault: str) -> None:
        rng, proxy, loop = self.rng, self.proxy, asyncio.get_running_loop()
        if fault in ("stall_data", "stall_deadline"):
            proxy.stall(rng.randint(0, 128 << 10), direction=rng.choice(["up", "down", "both"]),
                        conns=[self.data_conn])
            conn = self.data_conn
            loop.call_later(rng.uniform(0.01, 0.3), lambda: proxy.resume(conns=[conn]))
        elif fault in ("drop", "reset"):
            proxy.drop(reset=fault == "reset")
        elif fault == "truncate":
            proxy.truncate(rng.randint(0, 256 << 10), direction=rng.choice(["up", "down"]), conns=[self.data_conn])
        elif fault == "stall_all":
            proxy.stall()
            self.resume_at = loop.time() + 0.8
            loop.call_later(0.8, proxy.resume)

    async def transfer(self, op: tuple[str, list[int], list[int]], fault: str | None) -> bool | None:
        """One transfer, verified: True if it completed, False if not, None if the link has to be made again."""
        kind, a, b = op
        rng, dd = self.rng, self.dd
        timeout = {"deadline": rng.randint(1, 5), "stall_deadline": 30}.get(fault or "", 2000)
        if kind == "pull":
            call = dd.pull_kv_blocks(self.src, self.cache, a, b, timeout_in_millis=timeout)
        else:
            pushed = _crcs(self.local, a)
            call = dd.push_kv_blocks(self.cache, self.dst, a, b, timeout_in_millis=timeout)
        task = asyncio.ensure_future(call)
        if fault == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.003), task.cancel)
        self.counts["transfers"] += 1
        self.counts[kind] += 1
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            outcome = "cancelled"
        except LLMNotYetLink:
            outcome = "not_linked"
        except LLMTimeoutError as exc:
            outcome = "heartbeat" if "heartbeat" in str(exc) else "deadline"
        except LLMKvCacheNotExist:
            raise
        except LLMException as exc:
            outcome = exc.status_code.name
        else:
            outcome = "ok"
        self.counts[f"{kind}_{outcome}"] += 1
        if kind == "pull":
            now = _crcs(self.local, b)  # taken as the call returns: a failed pull's blocks must keep these
            if outcome == "ok":
                want = [self.src_crcs[s] for s in a]
                assert now == want, f"pull {a}->{b}: wrong bytes"
                self.counts["verified"] += 1
                self.counts["pull_verified"] += 1
                self.verified_bytes += len(a) * DESC.stride * TENSORS
            for blk, crc in zip(b, now):
                self.local_state[blk] = crc
                if outcome != "ok":  # not written again until a later call proves the stream drained
                    self.failed_now[blk] = crc
        else:
            if outcome == "ok":  # read the blocks back from the peer: the other calls of the round use others
                got = await self.peer.call("crcs", self.dst.cache_id, b)
                landed = [tuple(t[i] for t in got) for i in range(len(b))]
                assert landed == pushed, f"push {a}->{b}: the peer's blocks do not hold the pushed bytes"
                self.counts["verified"] += 1
                self.counts["push_verified"] += 1
                self.verified_bytes += len(a) * DESC.stride * TENSORS
            for blk, crc in zip(b, pushed):
                if outcome == "ok":
                    self.dst_state[blk] = crc
                else:
                    self.dst_state.pop(blk, None)  # undefined after a failed push
        if outcome not in ("ok", "cancelled", "deadline"):
            return None
        return outcome == "ok"

    async def checkpoint(self) -> None:
        """Everything recorded still holds: local blocks (late bytes would show), the peer's pushed blocks,
        guards on both sides; and when the link is idle nothing is outstanding."""
        link = inspect.links(self.dd).get(PEER)
        if link is not None and link.healthy:
            ep = link.endpoint
            assert isinstance(ep, tcp.TcpEndpoint)
            for _ in range(2000):  # abandoned frames drain once the peer answers them
                if ep._ch._out_frames == 0:
                    break
                await asyncio.sleep(0.001)
            else:
                self.proxy.resume()
        blocks = list(range(BLOCKS))
        assert _crcs(self.local, blocks) == [self.local_state[b] for b in blocks], "a local block changed"
        assert self.local.guards_ok()
        peer_crcs = await self.peer.call("crcs", self.dst.cache_id, blocks)
        for blk, want in self.dst_state.items():
            assert tuple(t[blk] for t in peer_crcs) == want, f"peer DST block {blk} does not hold what was pushed"
        assert await self.peer.call("guards_ok", self.dst.cache_id)
        assert await self.peer.call("guards_ok", self.src.cache_id)
        self.counts["checkpoints"] += 1


@pytest.mark.asyncio
@pytest.mark.timeout(max(120, N // 20))
async def test_soak() -> None:
    rng = random.Random(SEED)
    soak = Soak(rng)
    await soak.setup()
    t0 = time.monotonic()
    try:
        next_check = 250
        while soak.counts["transfers"] < N:
            await soak.round()
            if soak.counts["transfers"] >= next_check:
                await soak.checkpoint()
                next_check += 250
        soak.proxy.resume()
        if not inspect.links(soak.dd)[PEER].healthy:
            await soak.relink()
        await soak.checkpoint()
        # at the end: nothing pinned or outstanding, on either side
        local = inspect.local_cache(soak.dd, soak.cache.cache_id)
        assert local.inflight == 0 and not local.pins
        assert await soak.peer.call("inflight", soak.src.cache_id) == 0
        assert await soak.peer.call("inflight", soak.dst.cache_id) == 0
    finally:
        took = time.monotonic() - t0
        await soak.close()
    summary = {"seed": SEED, "seconds": round(took, 1), "verified_MiB": round(soak.verified_bytes / 2**20, 1),
               **dict(sorted(soak.counts.items()))}
    print("\nsoak:", json.dumps(summary))
    out = os.environ.get("KVFLOW_SOAK_OUT")
    if out:
        _write(out, summary)
    # (every completed transfer was verified as it returned: pulls here, pushes on the peer)
    c = soak.counts
    # a soak through faults: faults were injected and calls failed, and yet most completed, both kinds
    assert sum(v for k, v in c.items() if k.startswith("fault_")) > 0, dict(c)
    assert c["transfers"] > c["verified"], dict(c)
    assert c["verified"] >= 0.5 * N and c["pull_verified"] > 0 and c["push_verified"] > 0, dict(c)
    assert c["checkpoints"] >= N // 250


def _write(path: str, summary: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
