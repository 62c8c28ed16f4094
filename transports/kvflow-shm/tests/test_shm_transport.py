"""ShmTransport through LlmDataDist: a real peer process, handshake checks, cancellation, peer death."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import _peer
import numpy as np
import pytest
from conftest import Peer, requires_cma
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
    LLMParamInvalid,
    LlmRole,
)
from kvflow._memory import Registry
from kvflow.transport import LinkChannel, RemoteCache, RemoteRegion, RunBatch, TransportContext

import kvflow_shm
from kvflow_shm import ShmEndpoint, ShmTransport

pytestmark = requires_cma
SHM = {"kvflow.Transports": "shm"}


def _transport(options: dict[str, str] | None = None) -> ShmTransport:
    return ShmTransport(TransportContext(1, options or {}, Registry(), "test"))


class DataDistPeer:
    """An LlmDataDist serving one cache in a spawned process."""

    def __init__(self, options: dict[str, str], seed: int = 7) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer.serve_datadist, args=(child, options, seed), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError("peer did not start")
        info: dict[str, Any] = self.conn.recv()
        self.pid, self.port, self.cache_id = info["pid"], info["port"], info["cache_id"]

    async def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.conn.poll, 30):
            raise TimeoutError("peer did not answer")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


@pytest.mark.asyncio
async def test_pull_and_push_with_a_peer_process() -> None:
    peer = DataDistPeer(SHM)
    try:
        async with asyncio.timeout(60):
            async with LlmDataDist(2, LlmRole.DECODER, options=SHM) as dd:
                rets = await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", peer.port)])], 5000)
                assert [int(r) for r in rets] == [0]
                assert dd.link_info(1).transport == "shm"
                desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[64, 16384])
                mine = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
                cache = await dd.register_kv_cache(desc, mine)
                src = np.random.default_rng(1).permutation(64)[:48]
                dst = np.random.default_rng(2).permutation(64)[:48]
                await dd.pull_kv_blocks(CacheIndex(1, peer.cache_id), cache, src.tolist(), dst.tolist())
                theirs = [np.frombuffer(b, dtype=np.uint8) for b in await peer.call("contents")]
                for t in range(2):
                    assert np.array_equal(mine[t].reshape(64, -1)[dst], theirs[t].reshape(64, -1)[src])
                for t in mine:
                    t[:] = np.random.default_rng(3).integers(0, 256, t.size, dtype=np.uint8)
                await dd.push_kv_cache(cache, CacheIndex(1, peer.cache_id, 9), 4)
                await dd.push_kv_blocks(cache, CacheIndex(1, peer.cache_id), [0, 1, 2], [20, 21, 22])
                theirs = [np.frombuffer(b, dtype=np.uint8).reshape(64, -1) for b in await peer.call("contents")]
                for t in range(2):
                    assert np.array_equal(theirs[t][9], mine[t].reshape(64, -1)[4])
                    assert np.array_equal(theirs[t][20:23], mine[t].reshape(64, -1)[0:3])
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_peer_death_fails_fast() -> None:
    peer = DataDistPeer(SHM)
    try:
        async with asyncio.timeout(60):
            async with LlmDataDist(2, LlmRole.DECODER, options={**SHM, "kvflow.HeartbeatTimeout": "30000",
                                                                 "kvflow.HeartbeatInterval": "10000"}) as dd:
                await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", peer.port)])], 5000)
                desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[64, 16384])
                cache = await dd.register_kv_cache(desc, [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(2)])
                await dd.pull_kv_blocks(CacheIndex(1, peer.cache_id), cache, [0], [0])
                peer.proc.kill()
                peer.proc.join(10)
                t0 = time.monotonic()
                while dd.link_info(1).state == "linked" and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.01)
                assert dd.link_info(1).state != "linked", "peer death not noticed within 5 s"
                with pytest.raises(LLMException):
                    await dd.pull_kv_blocks(CacheIndex(1, peer.cache_id), cache, [0], [0])
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_cancel_returns_only_after_the_copy_thread_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    finished: list[float] = []
    real = kvflow_shm.ll.transfer

    def recording(*args: Any, **kw: Any) -> int:
        try:
            return real(*args, **kw)
        finally:
            if threading.current_thread() is not threading.main_thread():
                finished.append(time.monotonic())

    monkeypatch.setattr(kvflow_shm.ll, "transfer", recording)
    opts = {"llm.ListenIpInfo": "127.0.0.1:0", **SHM, "kvflow.shm.InlineBytes": "0"}
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[128, 256 << 10])  # 2 x 32 MiB
    async with asyncio.timeout(60):
        async with LlmDataDist(1, options=opts) as a, LlmDataDist(2, options=opts) as b:
            assert a.listen_address is not None
            await b.link_llm_clusters([ClusterInfo(1, [IpInfo(*a.listen_address)])], 5000)
            src = await a.register_kv_cache(desc, [np.ones(desc.tensor_bytes, np.uint8) for _ in range(2)])
            dst_mem = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(2)]
            dst = await b.register_kv_cache(desc, dst_mem)
            blocks = list(range(128))
            for delay in (0.0, 0.001, 0.002, 0.004):
                finished.clear()
                task = asyncio.ensure_future(b.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, blocks,
                                                              blocks[::-1]))
                await asyncio.sleep(delay)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                raised = time.monotonic()
                # either the copy never started, or its thread returned before the cancel did
                assert all(f <= raised for f in finished), (finished, raised)
                before = [m.copy() for m in dst_mem]
                await asyncio.sleep(0.05)
                assert all(np.array_equal(m, x) for m, x in zip(dst_mem, before, strict=True))


def test_describe_and_check_peer() -> None:
    t, other = _transport(), _transport()
    info = other.describe()
    assert info["pid"] == os.getpid() and len(info["nonce"]) == info["probe_len"]
    assert t.check_peer(info) is None
    assert "different host" in (t.check_peer({**info, "boot_id": "0" * 36}) or "")
    assert "different PID namespace" in (t.check_peer({**info, "pid_ns": 1}) or "")
    assert "other bytes" in (t.check_peer({**info, "nonce": bytes(16)}) or "")
    assert "probe read failed" in (t.check_peer({**info, "probe_addr": 8}) or "")
    assert "incomplete" in (t.check_peer({"pid": 1}) or "")


def _check_as_nobody(conn: Any, info: dict[str, Any]) -> None:
    from kvflow._memory import Registry as R
    from kvflow.transport import TransportContext as Ctx

    from kvflow_shm import ShmTransport as T
    from kvflow_shm import _lowlevel as ll

    assert ll.native_error() is None
    os.setgid(65534)
    os.setuid(65534)
    conn.send(T(Ctx(1, {}, R(), "x")).check_peer(info))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_check_peer_reports_ptrace_denial() -> None:
    t = _transport()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_check_as_nobody, args=(child, t.describe()), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        reason = parent.recv()
    finally:
        proc.join(10)
    assert reason is not None and reason.startswith("probe read failed") and "EPERM" in reason, reason


@pytest.mark.parametrize("key,value", [("kvflow.shm.InlineBytes", "lots"), ("kvflow.shm.Threads", "0")])
def test_bad_options(key: str, value: str) -> None:
    with pytest.raises(LLMParamInvalid, match=key):
        _transport({key: value})


class _Channel(LinkChannel):
    """Stands in for the core's channel in endpoint-level tests: records ``broken`` reports."""

    initiator = True
    peer_cluster_id = 1

    def __init__(self) -> None:
        self.reports: list[BaseException] = []

    async def open_stream(self) -> Any:
        raise AssertionError("shm needs no stream")

    def broken(self, exc: BaseException) -> None:
        self.reports.append(exc)


def _batch(t: ShmTransport, local_mem: np.ndarray, regions: list[tuple[int, int]], runs: list[tuple[int, int, int]],
           ) -> RunBatch:
    """Runs (local offset, remote region, remote offset) of ``bs`` bytes each, bs = len(local) / len(runs)."""
    bs = local_mem.size // len(runs)
    local = t.ctx.registry.add(CacheDesc(1, DataType.DT_UINT8, [len(runs), bs]), [local_mem])
    t.register(local)
    remote = RemoteCache(1, 1, CacheDesc(len(regions), DataType.DT_UINT8, [1]),
                         tuple(RemoteRegion(a, n) for a, n in regions))
    lo = np.array([r[0] for r in runs], dtype=np.uint64)
    rt = np.array([r[1] for r in runs], dtype=np.int64)
    ro = np.array([r[2] for r in runs], dtype=np.uint64)
    rbase = np.array([a for a, _ in regions], dtype=np.uint64)[rt]
    return RunBatch(np.uint64(local_mem.ctypes.data) + lo, rbase + ro, np.full(len(runs), bs, dtype=np.uint64),
                    np.zeros(len(runs), dtype=np.int64), rt, local, remote)


@pytest.mark.asyncio
async def test_split_batch_with_a_failing_part() -> None:
    peer = Peer(nbytes=16 << 20)
    try:
        async with asyncio.timeout(30):
            t, ch = _transport(), _Channel()
            ep = ShmEndpoint(t, peer.pid, None, ch)
            bs = 1 << 20
            mem = np.zeros(17 * bs, dtype=np.uint8)
            # 16 good runs, then one into the peer's guard map (page 0 mapped, page 1 PROT_NONE)
            regions = [(peer.addr, peer.nbytes), (peer.info["guard"], bs)]
            runs = [(i * bs, 0, i * bs) for i in range(16)] + [(16 * bs, 1, 0)]
            with pytest.raises(LLMKvCacheNotExist, match="EFAULT"):
                await ep.read(_batch(t, mem, regions, runs))
            assert ch.reports == []  # a missing remote page does not break the link
            good = _batch(t, mem[: 16 * bs], regions[:1], runs[:16])
            await ep.read(good)
            assert mem[: 16 * bs].tobytes() == peer.contents()
            await ep.close()
            await t.close()
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_abort_fails_inflight_copies_and_later_calls() -> None:
    peer = Peer(nbytes=64 << 20)
    try:
        async with asyncio.timeout(30):
            t, ch = _transport({"kvflow.shm.InlineBytes": "0"}), _Channel()
            ep = ShmEndpoint(t, peer.pid, None, ch)
            bs = 64 << 10
            n = peer.nbytes // bs
            mem = np.zeros(peer.nbytes, dtype=np.uint8)
            batch = _batch(t, mem, [(peer.addr, peer.nbytes)], [(i * bs, 0, (n - 1 - i) * bs) for i in range(n)])
            task = asyncio.ensure_future(ep.read(batch))
            await asyncio.sleep(0.001)
            ep.abort(LLMLinkFailed("test abort"))
            try:
                await task
            except LLMLinkFailed as exc:
                assert "test abort" in str(exc)
            with pytest.raises(LLMLinkFailed, match="closed"):
                await ep.read(batch)
            await t.close()
    finally:
        peer.stop()
