"""ShmTransport through LlmDataDist: a real peer process, handshake checks, cancellation, peer death."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
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


@pytest.mark.asyncio
async def test_describe_holds_no_pid_or_address_and_check_peer_probes_nothing() -> None:
    t, other = _transport(), _transport()
    info = other.describe()
    assert set(info) == {"boot_id", "hostname", "pid_ns", "net_ns", "uds"}  # no pid, uid or address
    assert t.check_peer(info) is None
    assert "different host" in (t.check_peer({**info, "boot_id": "0" * 36}) or "")
    assert "different PID namespace" in (t.check_peer({**info, "pid_ns": 1}) or "")
    assert "different network namespace" in (t.check_peer({**info, "net_ns": 1}) or "")
    assert "malformed rendezvous" in (t.check_peer({**info, "uds": "elsewhere"}) or "")
    assert "incomplete" in (t.check_peer({"pid": 1, "probe_addr": 8}) or "")
    await t.close()
    await other.close()


def _access_as_nobody(conn: Any, pid: int) -> None:
    from kvflow import LLMLinkFailed as Failed

    from kvflow_shm import _check_access

    os.setgid(65534)
    os.setuid(65534)
    try:
        _check_access(pid)
    except Failed as exc:
        conn.send(str(exc.args[0]))
    else:
        conn.send(None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_access_check_refuses_a_process_we_may_not_ptrace() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_access_as_nobody, args=(child, os.getpid()), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        reason = parent.recv()
    finally:
        proc.join(10)
    assert reason is not None and "no access to the memory of peer process" in reason, reason


def test_yama_ptrace_scope_is_detected(tmp_path: Any) -> None:
    """Yama is not enabled on this machine, so its sysctl is stood in for by files (the parser is real)."""
    from kvflow_shm import _yama_reason

    scope, status = tmp_path / "scope", tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    scope.write_text("0\n")
    assert _yama_reason(str(scope), str(status)) is None
    scope.write_text("1\n")
    assert "ptrace_scope=1" in (_yama_reason(str(scope), str(status)) or "")
    status.write_text("CapEff:\t0000000000080000\n")  # CAP_SYS_PTRACE
    assert _yama_reason(str(scope), str(status)) is None
    scope.write_text("3\n")
    assert "ptrace_scope=3" in (_yama_reason(str(scope), str(status)) or "")
    assert _yama_reason(str(tmp_path / "absent"), str(status)) is None


@pytest.mark.parametrize("key,value", [("kvflow.shm.InlineBytes", "lots"), ("kvflow.shm.Threads", "0")])
def test_bad_options(key: str, value: str) -> None:
    with pytest.raises(LLMParamInvalid, match=key):
        _transport({key: value})


@pytest.mark.asyncio
@requires_cma
async def test_misspelt_shm_option_is_refused_by_initialize() -> None:
    dd = LlmDataDist(1, LlmRole.DECODER)
    with pytest.raises(LLMParamInvalid, match=r"'kvflow\.shm\.InlineByte'.*kvflow\.shm\.InlineBytes, kvflow\.shm\.Threads"):
        await dd.initialize({**SHM, "kvflow.shm.InlineByte": "0"})


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


@contextlib.contextmanager
def _cyclic_garbage() -> Iterator[list[str]]:
    """The type names of what Python's cyclic collector had to free from what the block left."""
    gc.collect()
    flags, before = gc.get_debug(), len(gc.garbage)
    gc.set_debug(gc.DEBUG_SAVEALL)
    left: list[str] = []
    try:
        yield left
        gc.collect()
        left.extend(type(o).__qualname__ for o in gc.garbage[before:])
    finally:
        gc.set_debug(flags)
        del gc.garbage[before:]


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
async def test_a_large_batch_with_one_run_outside_the_peers_region_moves_nothing_and_leaves_no_garbage() -> None:
    """A batch of more than ``INLINE_RUNS`` runs is checked on a copy thread: one bad run (the last,
    past the end of the peer's region) fails the whole batch with a typed error before any byte
    moves, and the failure leaves nothing for the cyclic garbage collector."""
    peer = Peer(nbytes=4 << 20)
    try:
        async with asyncio.timeout(30):
            t, ch = _transport(), _Channel()
            ep = ShmEndpoint(t, peer.pid, None, ch)
            bs = 4 << 10
            n = peer.nbytes // bs  # 1024 runs
            mem = np.zeros(n * bs, dtype=np.uint8)
            runs = [(i * bs, 0, i * bs) for i in range(n - 1)] + [((n - 1) * bs, 0, n * bs)]
            bad = _batch(t, mem, [(peer.addr, peer.nbytes)], runs)
            with pytest.raises(LLMParamInvalid, match=f"run {n - 1} .* is outside remote cache"):
                await ep.read(bad)  # first run: starts the copy threads
            with _cyclic_garbage() as left, pytest.raises(LLMParamInvalid, match="is outside remote cache"):
                await ep.read(bad)
            assert left == []
            assert not mem.any()  # nothing moved, not even the good runs
            assert ch.reports == []  # a refused batch does not break the link
            await ep.close()
            await t.close()
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_abort_fails_inflight_copies_and_later_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``abort`` while every worker thread is between two syscalls of its copy: the read fails with the
    abort's own LLMLinkFailed, the native loop stops at the stop flag (nothing after the abort moves),
    ``abort`` itself does not wait for the threads, and later calls fail at once."""
    from kvflow_shm import _lowlevel as ll

    peer = Peer(nbytes=64 << 20)
    try:
        async with asyncio.timeout(30):
            t, ch = _transport({"kvflow.shm.InlineBytes": "0", "kvflow.shm.Threads": "2"}), _Channel()
            ep = ShmEndpoint(t, peer.pid, None, ch)
            bs = 64 << 10
            n = peer.nbytes // bs
            mem = np.zeros(peer.nbytes, dtype=np.uint8)
            base = int(mem.ctypes.data)
            batch = _batch(t, mem, [(peer.addr, peer.nbytes)], [(i * bs, 0, (n - 1 - i) * bs) for i in range(n)])
            # Each part of the batch (one per worker thread) copies its first half for real, then waits
            # at that syscall boundary until the test has aborted, then runs the real native loop on its
            # second half with the op's stop flag, which abort() has set by then.
            real = ll.transfer
            halfway = threading.Semaphore(0)
            aborted = threading.Event()
            lock = threading.Lock()
            parts: list[tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], BaseException | None]] = []

            def paused(pid: int, write: bool, local: np.ndarray, remote: np.ndarray, lens: np.ndarray,
                       *rest: Any, **kw: Any) -> int:
                h = lens.size // 2
                runs = [(int(lo) - base, int(ro) - peer.addr, int(ln)) for lo, ro, ln in zip(local, remote, lens)]
                lt, rt, *regions = rest
                real(pid, write, local[:h], remote[:h], lens[:h], lt[:h], rt[:h], *regions, **kw)
                halfway.release()
                if not aborted.wait(10):
                    raise AssertionError("the test never aborted")
                try:
                    return real(pid, write, local[h:], remote[h:], lens[h:], lt[h:], rt[h:], *regions, **kw)
                except BaseException as exc:
                    with lock:
                        parts.append((runs[:h], runs[h:], exc))
                    raise

            monkeypatch.setattr(ll, "transfer", paused)
            task = asyncio.ensure_future(ep.read(batch))
            loop = asyncio.get_running_loop()
            for _ in range(2):  # both worker threads hold half-copied parts
                assert await loop.run_in_executor(None, halfway.acquire, True, 10)
            assert not task.done()
            t0 = time.perf_counter()
            ep.abort(LLMLinkFailed("test abort"))
            assert time.perf_counter() - t0 < 1.0  # it set the flag; it did not wait for the paused threads
            aborted.set()
            with pytest.raises(LLMLinkFailed, match="test abort"):
                await task
            assert len(parts) == 2
            src = np.frombuffer(peer.contents(), dtype=np.uint8)
            for before, after, exc in parts:
                # the native loop itself stopped, before its first syscall after the abort
                assert isinstance(exc, ll.CopyStopped) and exc.done == 0, exc
                for lo, ro, ln in before:
                    assert np.array_equal(mem[lo:lo + ln], src[ro:ro + ln])
                for lo, _, ln in after:
                    assert not mem[lo:lo + ln].any()
            landed = mem.copy()
            monkeypatch.undo()
            with pytest.raises(LLMLinkFailed, match="closed"):
                await ep.read(batch)
            assert np.array_equal(mem, landed)
            await t.close()
    finally:
        peer.stop()


def _reversed_runs(n: int, bs: int) -> list[tuple[int, int, int]]:
    return [(i * bs, 0, (n - 1 - i) * bs) for i in range(n)]


async def _until_bytes_land(mem: np.ndarray) -> None:
    for _ in range(400):
        await asyncio.sleep(0.0005)
        if mem.any():
            return


@pytest.mark.asyncio
@pytest.mark.parametrize("runs", [1024, 256])  # checked and split on a copy thread; checked by read_now
async def test_cancelling_a_copy_in_flight_reports_no_unretrieved_error(runs: int) -> None:
    """Cancel a read while its parts copy: each part's CopyStopped is consumed by the cancelled call,
    so the loop's exception handler never hears of a "Future exception was never retrieved"."""
    peer = Peer(nbytes=64 << 20)
    loop = asyncio.get_running_loop()
    reports: list[str] = []
    loop.set_exception_handler(lambda _loop, ctx: reports.append(f"{ctx['message']} {ctx.get('exception')!r}"))
    try:
        async with asyncio.timeout(60):
            t = _transport({"kvflow.shm.InlineBytes": "0", "kvflow.shm.Threads": "2"})
            ep = ShmEndpoint(t, peer.pid, None, _Channel())
            mem = np.zeros(peer.nbytes, dtype=np.uint8)
            batch = _batch(t, mem, [(peer.addr, peer.nbytes)], _reversed_runs(runs, peer.nbytes // runs))
            cancelled = 0
            for _ in range(8):
                task = asyncio.ensure_future(ep.read(batch))
                await _until_bytes_land(mem)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                cancelled += task.cancelled()
                del task
                mem[:] = 0
                gc.collect()
                await asyncio.sleep(0.01)
            assert cancelled > 0  # the copy was still running when cancelled, at least once
            assert reports == []
            await ep.close()
            await t.close()
    finally:
        loop.set_exception_handler(None)
        peer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["abort", "close"])
async def test_a_copy_failed_by_abort_or_close_leaves_no_garbage(how: str) -> None:
    """The error a waiting copy raises when its endpoint is aborted or closed is a fresh exception:
    raising the stored one tied the endpoint, the error and the raising frame into a cycle."""
    peer = Peer(nbytes=64 << 20)
    try:
        async with asyncio.timeout(60):
            t = _transport({"kvflow.shm.InlineBytes": "0", "kvflow.shm.Threads": "2"})
            mem = np.zeros(peer.nbytes, dtype=np.uint8)

            async def one() -> None:
                ep = ShmEndpoint(t, peer.pid, None, _Channel())

                async def stop_it() -> None:
                    await _until_bytes_land(mem)
                    if how == "abort":
                        ep.abort(LLMLinkFailed("test abort"))
                    else:
                        await ep.close()

                # the read is awaited here, not through a task held in a local: a task that holds
                # its own exception, whose traceback holds this frame, would be a cycle of the test's
                stopper = asyncio.ensure_future(stop_it())
                with contextlib.suppress(LLMLinkFailed):
                    await ep.read(_batch(t, mem, [(peer.addr, peer.nbytes)], _reversed_runs(1024, peer.nbytes // 1024)))
                await stopper
                await ep.close()
                mem[:] = 0

            await one()  # starts the copy threads
            with _cyclic_garbage() as left:
                await one()
                await asyncio.sleep(0.05)
            assert left == []
            await t.close()
    finally:
        peer.stop()


@pytest.mark.asyncio
async def test_close_waits_for_a_copy_stalled_in_the_peers_page_fault(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A peer whose pages fault without end (userfaultfd) holds our copy thread inside
    ``process_vm_readv``: ``close()`` keeps waiting (and says so) rather than return while that
    syscall can still write into our memory. Once the peer lets go, close() returns, and no byte
    lands after it."""
    monkeypatch.setattr(kvflow_shm, "CLOSE_WARN_S", 0.2)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer.serve_faulting, args=(child, 2 << 20), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(30)
        info = conn.recv()
        if "error" in info:
            pytest.skip(f"this machine does not let a test process use {info['error']}")
        async with asyncio.timeout(60):
            t = _transport({"kvflow.shm.InlineBytes": "0", "kvflow.shm.Threads": "2"})
            ep = ShmEndpoint(t, info["pid"], None, _Channel())
            bs, n = 4096, 300  # more than INLINE_RUNS: checked and split on a copy thread
            mem = np.zeros(n * bs, dtype=np.uint8)
            task = asyncio.ensure_future(ep.read(_batch(t, mem, [(info["addr"], info["nbytes"])],
                                                        [(i * bs, 0, i * bs) for i in range(n)])))
            await asyncio.sleep(0.3)
            assert not task.done() and not mem.any()  # stalled in the peer's first page fault
            with caplog.at_level(logging.WARNING, logger="kvflow.shm"):
                closing = asyncio.ensure_future(ep.close())
                await asyncio.sleep(0.6)
                assert not closing.done()
                assert "still inside a syscall after close" in caplog.text
            conn.send(("resolve", 0xAB))
            await closing
            landed = int(np.count_nonzero(mem))
            await asyncio.sleep(0.3)
            assert int(np.count_nonzero(mem)) == landed  # nothing lands after close() returned
            with pytest.raises(LLMLinkFailed, match="link closed"):
                await task
            await t.close()
    finally:
        proc.kill()
        proc.join(10)


@pytest.mark.asyncio
@pytest.mark.parametrize("runs", [1024, 256])  # submitted by a copy thread; by the loop
async def test_a_copy_that_meets_a_shut_down_pool_fails_with_a_typed_error(runs: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport closing under a copy (its pool shut down between the call and the submit) is
    LLMLinkFailed, not the executor's bare RuntimeError; nothing moves."""
    peer = Peer(nbytes=16 << 20)
    try:
        async with asyncio.timeout(30):
            t = _transport({"kvflow.shm.InlineBytes": "0"})
            ep = ShmEndpoint(t, peer.pid, None, _Channel())
            mem = np.zeros(peer.nbytes, dtype=np.uint8)
            batch = _batch(t, mem, [(peer.addr, peer.nbytes)], _reversed_runs(runs, peer.nbytes // runs))
            if runs > kvflow_shm.INLINE_RUNS:  # the head job runs; the parts it submits meet the shut-down pool
                pool = t._executor()
                real_submit = pool.submit

                def submit_then_shut(fn: Any, *args: Any, **kwargs: Any) -> Any:
                    fut = real_submit(fn, *args, **kwargs)
                    pool.shutdown(wait=False)
                    return fut

                monkeypatch.setattr(pool, "submit", submit_then_shut)
            else:
                t._executor().shutdown(wait=False)
            with pytest.raises(LLMLinkFailed, match="copy threads are shut down"):
                await ep.read(batch)
            assert not mem.any()
            await ep.close()
            await t.close()
    finally:
        peer.stop()
