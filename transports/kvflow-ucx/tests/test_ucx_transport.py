"""UcxTransport through LlmDataDist: conformance over TCP and shared memory, peer death, idle CPU."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from kvflow import (
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMException,
    LLMLinkFailed,
    LLMParamInvalid,
    LlmRole,
    LLMTimeoutError,
    Placement,
    available_transports,
)
from kvflow._compat import timeout as timeout_after
from kvflow._discovery import load_transport
from kvflow._plan import plan_blocks
from kvflow._proc import PeerProcess
from kvflow.testing import check_transport, inspect
from ucx_testlib import TLS_PARAMS, datadist_peer, proc_cpu_seconds, requires_ucx

from kvflow_ucx import UcxTransport
from kvflow_ucx import _lowlevel as ll
from kvflow_ucx._transport import _ucx_config

pytestmark = requires_ucx


def _lib_version() -> tuple[int, int]:
    major, minor = ll.versions()["library"].split(".")[:2]
    return int(major), int(minor)


def _opts(tls: str, **extra: str) -> dict[str, str]:
    return {"kvflow.Transports": "ucx", "kvflow.ucx.TLS": tls, **extra}


def test_found_by_name() -> None:
    assert available_transports()["ucx"] == "ok"
    assert load_transport("ucx") is UcxTransport


def test_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("UCX_TCP_TX_SEG_SIZE", "UCX_MM_ERROR_HANDLING", "UCX_POSIX_ERROR_HANDLING"):
        monkeypatch.delenv(var, raising=False)
    cfg, own, defaults = _ucx_config({"kvflow.ucx.TLS": "tcp,sm", "kvflow.ucx.UCX_NET_DEVICES": "lo",
                                      "kvflow.ucx.RequireRdma": "0", "kvflow.other.X": "1",
                                      "kvflow.ucx.MM_ERROR_HANDLING": "n"})
    assert cfg["TLS"] == "tcp,sm" and cfg["NET_DEVICES"] == "lo"
    assert cfg["MM_ERROR_HANDLING"] == "n" and "MM_ERROR_HANDLING" not in defaults  # an option wins
    if _lib_version() >= (1, 22):
        assert cfg["TCP_TX_SEG_SIZE"] == "256k" and "TCP_TX_SEG_SIZE" in defaults
    assert own == {"RequireRdma": "no"}
    cfg, _, _ = _ucx_config({"kvflow.ucx.TLS": "tcp"})
    assert "MM_ERROR_HANDLING" not in cfg  # not for a transport UCX_TLS leaves out
    assert "MM_ERROR_HANDLING" in _ucx_config({"kvflow.ucx.TLS": "^tcp"})[0]
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    monkeypatch.setenv("UCX_POSIX_ERROR_HANDLING", "n")
    cfg, _, _ = _ucx_config({})
    assert "TCP_TX_SEG_SIZE" not in cfg and "MM_ERROR_HANDLING" not in cfg  # the environment wins
    with pytest.raises(LLMParamInvalid, match=r"kvflow\.ucx\.tls"):
        _ucx_config({"kvflow.ucx.tls": "tcp"})
    with pytest.raises(LLMParamInvalid, match="RequireRdma"):
        _ucx_config({"kvflow.ucx.RequireRdma": "maybe"})


@pytest.mark.asyncio
async def test_check_peer_prefers_kvflow_tcp_without_rdma() -> None:
    from kvflow._memory import Registry
    from kvflow.transport import TransportContext

    t = UcxTransport(TransportContext(1, {"kvflow.ucx.TLS": "tcp"}, Registry(), "x"))
    forced = UcxTransport(TransportContext(2, {"kvflow.ucx.TLS": "tcp", "kvflow.ucx.RequireRdma": "no"},
                                           Registry(), "y"))
    try:
        me = t.describe()
        assert isinstance(me["address"], bytes) and me["rdma"] == []
        assert t.check_peer(me) is None  # same host: UCX uses shared memory or loopback
        other = {**me, "host": "elsewhere/boot"}
        assert "no RDMA transport on either side" in (t.check_peer(other) or "")
        assert forced.check_peer(other) is None
        t.rdma = ["rc_mlx5/mlx5_0:1"]
        assert t.check_peer({**other, "rdma": ["rc_verbs/mlx5_1:1"]}) is None
        assert "the peer" in (t.check_peer(other) or "")
        assert t.check_peer({"address": b""}) is not None
    finally:
        await t.close()
        await forced.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [*TLS_PARAMS, pytest.param("self,sm,cma", id="self-sm-cma")])
async def test_conformance(tls: str) -> None:
    await check_transport("ucx", options={"kvflow.ucx.TLS": tls}, timeout=120)


@pytest.mark.parametrize("tls", TLS_PARAMS)
def test_conformance_with_ucx_tls_in_the_environment(tls: str) -> None:
    """The same suite in a fresh interpreter whose environment has UCX_TLS set (no options)."""
    code = textwrap.dedent("""
        import asyncio
        from kvflow.testing import check_transport
        asyncio.run(check_transport("ucx", timeout=120))
        print("conformance ok")
    """)
    env = {**os.environ, "UCX_TLS": tls}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "conformance ok" in out.stdout


@pytest.mark.asyncio
@pytest.mark.parametrize("tls,lane", [("tcp", "tcp/"), ("sm", "cma/")])
async def test_lanes_follow_ucx_tls(tls: str, lane: str) -> None:
    if lane == "cma/" and _lib_version() < (1, 22):  # older UCX: no CMA RMA in peer-error mode
        lane = "sysv/"
    await _check_lanes(tls, lane)


@contextlib.asynccontextmanager
async def _linked_pair(opts: dict[str, str]) -> AsyncIterator[tuple[LlmDataDist, LlmDataDist]]:
    """A prompt instance listening on loopback and a decoder instance linked to it, both with ``opts``."""
    async with LlmDataDist(1, LlmRole.PROMPT, options={**opts, "llm.ListenIpInfo": "127.0.0.1:0"}) as a, \
            LlmDataDist(2, LlmRole.DECODER, options=opts) as b:
        assert a.listen_address is not None
        assert await b.link_llm_clusters([ClusterInfo(1, [IpInfo(*a.listen_address)])], 5000) == [0]
        yield a, b


async def _check_lanes(tls: str, lane: str) -> None:
    """Link two instances with UCX_TLS=``tls``, pull, and find ``lane`` in the endpoint's lanes."""
    opts = _opts(tls)
    async with _linked_pair(opts) as (a, b):
        desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=[4, 65536])
        src = [np.arange(desc.tensor_bytes, dtype=np.uint64).astype(np.uint8)]
        dst = [np.zeros(desc.tensor_bytes, dtype=np.uint8)]
        ca = await a.register_kv_cache(desc, src)
        cb = await b.register_kv_cache(desc, dst)
        await b.pull_kv_blocks(CacheIndex(1, ca.cache_id), cb, [0, 1, 2, 3], [0, 1, 2, 3])
        assert np.array_equal(src[0], dst[0])
        info = inspect.link(b, 1).endpoint.info()  # type: ignore[union-attr]
        assert lane in info, info


@pytest.mark.asyncio
async def test_one_block_on_the_spot_never_reaches_past_a_peers_described_region() -> None:
    """A peer that describes more blocks than its regions hold: the C-planned one-block path
    declines the last block (bounds checked before anything is issued), and the Python-planned
    path then refuses it with a typed error; not a byte moves either way."""
    if _lib_version() < (1, 22):
        pytest.skip("older UCX: no CMA RMA in peer-error mode")
    from dataclasses import replace

    from kvflow.transport import RemoteRegion

    async with _linked_pair(_opts("sm")) as (a, b):
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[8, 4096])
        src = [np.full(desc.tensor_bytes, 7, dtype=np.uint8) for _ in range(2)]
        dst = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        ca = await a.register_kv_cache(desc, src)
        cb = await b.register_kv_cache(desc, dst)
        await b.pull_kv_blocks(CacheIndex(1, ca.cache_id), cb, [0], [0])  # wires the endpoint up
        dst[0][:] = 0
        dst[1][:] = 0
        link = inspect.link(b, 1)
        ep, honest = link.endpoint, link.remotes[ca.cache_id]
        assert ep is not None
        short = tuple(RemoteRegion(r.addr, r.nbytes - 1, r.desc) for r in honest.regions)  # last byte kept
        cut = replace(honest, regions=short, cache={})
        local = b._engine._registry.lookup(cb.cache_id)
        assert local is not None
        assert ep.blocks_now(False, local, cut, [7], [0]) is None
        assert ep.blocks_now(False, local, cut, [6], [0]) == (2 * 4096, 2)  # inside the regions: moved
        assert all(np.all(d[:4096] == 7) for d in dst)
        plan = plan_blocks(cut.desc, cut.addrs, local.desc, local.addrs, [7], [1], None, local_is_src=False)
        with pytest.raises(LLMParamInvalid):
            ep.read_now(plan.batch(local, cut))
        assert not any(d[4096:].any() for d in dst)


@pytest.mark.asyncio
@pytest.mark.parametrize("tls,now", [("sm", True), ("tcp", False)])
async def test_small_transfers_complete_on_the_spot_only_over_shared_memory(
        tls: str, now: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull or push of at most NOW_BYTES over CMA is checked, issued and completed in read_now /
    write_now (no event fd, no task switch), a block transfer without even the engine's coroutine
    path; a larger one, or any over tcp, takes the async path."""
    if now and _lib_version() < (1, 22):
        pytest.skip("older UCX: no CMA RMA in peer-error mode")
    from kvflow_ucx._transport import NOW_BYTES

    opts = _opts(tls)
    async with _linked_pair(opts) as (a, b):
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[32, 4096])
        rng = np.random.default_rng(5)
        src = [rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        dst = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        ca = await a.register_kv_cache(desc, src)
        cb = await b.register_kv_cache(desc, dst)
        remote = CacheIndex(1, ca.cache_id)
        await b.pull_kv_blocks(remote, cb, [0], [0])  # wires the endpoint up
        ep = inspect.link(b, 1).endpoint
        before = ep.moved_now  # type: ignore[union-attr]
        engine = b._engine
        runs = 0
        run = engine.run

        async def counted(*args: Any, **kw: Any) -> None:
            nonlocal runs
            runs += 1
            await run(*args, **kw)

        monkeypatch.setattr(engine, "run", counted)
        for i in range(8):
            await b.pull_kv_blocks(remote, cb, [i], [7 - i])
        for t in range(2):
            for i in range(8):
                assert np.array_equal(dst[t][(7 - i) * 4096:(8 - i) * 4096], src[t][i * 4096:(i + 1) * 4096])
        dst[0][:] = rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8)
        await b.push_kv_blocks(cb, remote, [3], [5])
        for t in range(2):
            assert np.array_equal(src[t][5 * 4096:6 * 4096], dst[t][3 * 4096:4 * 4096])
        assert ep.moved_now - before == (9 if now else 0)  # type: ignore[union-attr]
        assert runs == (0 if now else 9)
        assert desc.tensor_bytes * 2 > NOW_BYTES  # every block of both tensors: too large for the spot
        await b.pull_kv_blocks(remote, cb, list(range(32)), list(range(32)))
        assert all(np.array_equal(s_, d_) for s_, d_ in zip(src, dst, strict=True))
        assert ep.moved_now - before == (9 if now else 0)  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_large_batches_over_shared_memory_are_copied_by_the_helper_thread_not_the_loop() -> None:
    """Over CMA each progress call is a copy: a batch of HELPER_BYTES or more is progressed by the
    worker's helper thread while the loop only issues and drains events. Checked by CPU time, the
    loop thread's against the whole process's (which includes the helper's copying), not by wall
    clock. Small pulls on the spot beside the large ones share the worker and land exactly."""
    if _lib_version() < (1, 22):
        pytest.skip("older UCX: no CMA RMA in peer-error mode")
    from kvflow_ucx._transport import HELPER_BYTES

    async with _linked_pair(_opts("sm")) as (a, b):
        big = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[16, 4 << 20])  # 2 x 64 MiB
        small = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[8, 4096])
        rng = np.random.default_rng(11)
        src = [rng.integers(0, 256, big.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        dst = [np.zeros(big.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        small_src = [rng.integers(0, 256, small.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        small_dst = [np.zeros(small.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        remote = CacheIndex(1, (await a.register_kv_cache(big, src)).cache_id)
        remote_small = CacheIndex(1, (await a.register_kv_cache(small, small_src)).cache_id)
        cb = await b.register_kv_cache(big, dst)
        cs = await b.register_kv_cache(small, small_dst)
        await b.pull_kv_blocks(remote_small, cs, [0], [0])  # wires the endpoint up
        ep = inspect.link(b, 1).endpoint
        progress, now_before = ep._progress, ep.moved_now  # type: ignore[union-attr]
        assert big.tensor_bytes * 2 >= HELPER_BYTES
        every = list(range(16))
        handovers = progress.handovers
        loop_cpu = all_cpu = 0.0
        for i in range(4):
            for d in dst:
                d[:] = 0
            cpu0, all0 = time.thread_time(), time.process_time()
            task = asyncio.ensure_future(b.pull_kv_blocks(remote, cb, every, every))
            await asyncio.sleep(0)
            await b.pull_kv_blocks(remote_small, cs, [i], [7 - i])  # on the spot, beside the large pull
            await task
            loop_cpu += time.thread_time() - cpu0
            all_cpu += time.process_time() - all0
            assert all(np.array_equal(s_, d_) for s_, d_ in zip(src, dst, strict=True))
        print(f"\nloop thread {loop_cpu * 1e3:.1f} ms of CPU, process {all_cpu * 1e3:.1f} ms, for 4 pulls of "
              f"{big.tensor_bytes * 2 >> 20} MiB")
        assert progress.handovers > handovers
        assert loop_cpu < 0.5 * all_cpu
        assert ep.moved_now - now_before == 4  # type: ignore[union-attr]
        for t in range(2):
            for i in range(4):
                assert np.array_equal(small_dst[t][(7 - i) * 4096:(8 - i) * 4096],
                                      small_src[t][i * 4096:(i + 1) * 4096])


async def _helper_pulls(window: int | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pull 2 x 64 MiB of 16 KiB blocks in shuffled order over CMA, three times, with the helper
    thread's window set to ``window`` bytes (None: the default); each pull's bytes are checked and
    the number of times the helper woke the loop for it is returned."""
    if _lib_version() < (1, 22):
        pytest.skip("older UCX: no CMA RMA in peer-error mode")
    from kvflow_ucx import _transport as tr

    if window is not None:
        monkeypatch.setattr(tr, "HELPER_WINDOW", window)
    async with _linked_pair(_opts("sm")) as (a, b):
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[4096, 16 << 10])
        rng = np.random.default_rng(5)
        src = [rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        dst = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        remote = CacheIndex(1, (await a.register_kv_cache(desc, src)).cache_id)
        local = await b.register_kv_cache(desc, dst)
        order = [int(x) for x in rng.permutation(4096)]
        await b.pull_kv_blocks(remote, local, [0], [0])  # wires the endpoint up
        progress = inspect.link(b, 1).endpoint._progress  # type: ignore[union-attr]
        notices = []
        for _ in range(3):
            for d in dst:
                d[:] = 0
            before = progress.notices
            await b.pull_kv_blocks(remote, local, list(range(4096)), order, timeout_in_millis=30_000)
            notices.append(progress.notices - before)
            for s_, d_ in zip(src, dst, strict=True):
                assert np.array_equal(d_.reshape(4096, -1)[order], s_.reshape(4096, -1))
        return notices


@pytest.mark.asyncio
async def test_a_large_batch_on_the_helper_thread_wakes_the_loop_only_to_finish(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """8192 scattered runs, 128 MiB: the loop issues them all in calls of HELPER_RUNS and then sleeps;
    the helper wakes it for the completion and its own stop, not for each chunk (a 64 MiB window of
    16 MiB chunks woke it for each of them, and each wake can make a host's sleep late)."""
    notices = await _helper_pulls(None, monkeypatch)
    print(f"\nhelper wake-ups of the loop per 128 MiB pull: {notices}")
    assert max(notices) <= 2


@pytest.mark.asyncio
async def test_a_batch_larger_than_the_helper_window_waits_for_half_of_it_and_lands_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the window cut to 8 MiB the loop waits for freed window many times per pull (a chunk
    frees its bytes when its last run completes: 16 waits); the helper tells it each time half the
    window is free (kvf_worker_wake_below), and every byte lands."""
    notices = await _helper_pulls(8 << 20, monkeypatch)
    print(f"\nhelper wake-ups of the loop per 128 MiB pull, 8 MiB window: {notices}")
    assert min(notices) >= 8  # 128 MiB through an 8 MiB window: it waited, and was woken each time


@pytest.mark.requires_rdma
@pytest.mark.asyncio
async def test_conformance_over_rdma() -> None:
    """On a host with an active RDMA port: the suite over UCX's RC transport, and RC lanes chosen."""
    from kvflow._memory import Registry
    from kvflow.transport import TransportContext

    t = UcxTransport(TransportContext(1, {"kvflow.ucx.TLS": "rc,self"}, Registry(), "x"))
    try:
        if not t.rdma:
            pytest.skip(f"this UCX build has no RDMA transport (it opened {t._worker.transports()}); "
                        "rebuild kvflow-ucx with KVFLOW_UCX_PREFIX (docs/ucx.md)")
    finally:
        await t.close()
    await check_transport("ucx", options={"kvflow.ucx.TLS": "rc,self"}, timeout=300)
    await _check_lanes("rc,self", "rc_")


@pytest.mark.asyncio
async def test_device_placement_goes_through_the_same_registration() -> None:
    """Placement.DEVICE caches are ucp_mem_map'ed with the memory type left to UCX's detection.

    No GPU here: host memory declared DEVICE exercises the path; real device memory is unverified."""
    opts = _opts("sm")
    async with _linked_pair(opts) as (a, b):
        desc = CacheDesc(2, DataType.DT_UINT8, [8, 4096], placement=Placement.DEVICE)
        src = [np.random.default_rng(t).integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for t in range(2)]
        dst = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(2)]
        ca = await a.register_kv_cache(desc, [int(x.ctypes.data) for x in src])
        cb = await b.register_kv_cache(desc, [int(x.ctypes.data) for x in dst])
        await b.pull_kv_blocks(CacheIndex(1, ca.cache_id), cb, list(range(8)), list(range(8))[::-1])
        for s, d in zip(src, dst):
            assert np.array_equal(s.reshape(8, -1)[::-1], d.reshape(8, -1))
        await b.unregister_kv_cache(cb.cache_id)
        await a.unregister_kv_cache(ca.cache_id)


async def _start_peer(tls: str, shape: list[int], tensors: int = 4, **extra: str) -> tuple[PeerProcess, dict]:
    peer = PeerProcess(datadist_peer)
    peer.send({"tensors": tensors, "shape": shape,
               "options": {**_opts(tls, **extra), "llm.ListenIpInfo": "127.0.0.1:0"}})
    try:
        return peer, await peer.recv(60)
    except BaseException:
        peer.stop()
        raise


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", TLS_PARAMS)
async def test_peer_killed_mid_transfer_fails_within_the_deadline(tls: str) -> None:
    deadline_ms = 3000
    extra = {"llm.SyncKvCacheWaitTime": str(deadline_ms)}
    shape = [64, 256 << 10]  # 4 tensors x 16 MiB
    peer, info = await _start_peer(tls, shape, **extra)
    try:
        async with timeout_after(60):
            async with LlmDataDist(2, LlmRole.DECODER, options=_opts(tls, **extra)) as dd:
                assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", info["port"])])],
                                                  5000) == [0]
                desc = CacheDesc(4, DataType.DT_UINT8, shape)
                zeros = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(4)]
                cache = await dd.register_kv_cache(desc, zeros)
                ci = CacheIndex(1, info["cache_id"])
                blocks = list(range(shape[0]))
                await dd.pull_kv_blocks(ci, cache, blocks, blocks[::-1])  # wired up and working
                endpoint = inspect.link(dd, 1).endpoint

                async def pull_forever() -> None:
                    while True:
                        await dd.pull_kv_blocks(ci, cache, blocks, blocks[::-1])

                task = asyncio.ensure_future(pull_forever())
                for _ in range(10_000):  # kill while a batch is in flight
                    await asyncio.sleep(0)
                    if endpoint._inflight:  # type: ignore[union-attr]
                        break
                assert endpoint._inflight, "no transfer was in flight"  # type: ignore[union-attr]
                loop = asyncio.get_running_loop()
                os.kill(peer.pid, signal.SIGKILL)
                killed = loop.time()
                with pytest.raises(LLMException) as err:
                    await asyncio.wait_for(task, deadline_ms / 1000 + 5)
                elapsed = loop.time() - killed
                print(f"\n[{tls}] peer killed mid-transfer: {type(err.value).__name__} after "
                      f"{elapsed * 1000:.0f} ms: {err.value}")
                assert isinstance(err.value, (LLMLinkFailed, LLMTimeoutError))
                assert elapsed < deadline_ms / 1000 + 0.5
                with pytest.raises(LLMException):  # later calls fail at once, typed; nothing hangs
                    await asyncio.wait_for(dd.pull_kv_blocks(ci, cache, [0], [0]), 2)
    finally:
        peer.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", TLS_PARAMS)
async def test_idle_linked_pair_uses_no_cpu(tls: str) -> None:
    """Linked, wired up, then idle for a few seconds: both processes sleep (no UCX polling)."""
    peer, info = await _start_peer(tls, [16, 65536], tensors=2)
    try:
        async with timeout_after(60):
            async with LlmDataDist(2, LlmRole.DECODER, options=_opts(tls)) as dd:
                assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", info["port"])])],
                                                  5000) == [0]
                desc = CacheDesc(2, DataType.DT_UINT8, [16, 65536])
                zeros = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(2)]
                cache = await dd.register_kv_cache(desc, zeros)
                every = list(range(16))
                await dd.pull_kv_blocks(CacheIndex(1, info["cache_id"]), cache, every, every)
                transport = inspect.transport(dd, "ucx")
                await asyncio.sleep(0.5)
                # both workers: ours (our endpoints) and the target (peers' endpoints to us)
                progress = (transport._progress, transport._target_progress)  # type: ignore[attr-defined]
                wake0 = sum(p.wakeups for p in progress)
                me0, peer0, t0 = time.process_time(), proc_cpu_seconds(peer.pid), time.monotonic()
                await asyncio.sleep(3.0)
                wall = time.monotonic() - t0
                me = (time.process_time() - me0) / wall
                other = (proc_cpu_seconds(peer.pid) - peer0) / wall
                wakeups = sum(p.wakeups for p in progress) - wake0
                print(f"\n[{tls}] idle linked pair over {wall:.1f} s: this process {me * 100:.2f}% CPU, "
                      f"peer {other * 100:.2f}% CPU, UCX event-fd wakeups {wakeups}")
                assert me < 0.03 and other < 0.03
                assert wakeups <= 3
    finally:
        peer.stop()
