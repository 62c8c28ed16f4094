"""kvflow.sync's fast path: small shm transfers copied on the caller's own thread.

A blocking pull or push of a batch small enough for ``read_now``, over a transport whose endpoint
allows it from any thread (shm), runs on the calling thread with no hand-off to the facade's loop
(see ``TransferEngine.run_now`` and docs/sync.md). These tests show that it does (the loop thread is
held busy meanwhile), that it keeps the facade's semantics (typed errors, counted in ``stats()``),
and that it never races what the loop thread retires: a local unregister, the peer's unregister,
a dead peer. tcp, which has no such path, is the control.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvflow.sync
from kvflow import (
    CacheDesc,
    CacheIndex,
    DataType,
    LLMException,
    LLMKvCacheNotExist,
    LLMParamInvalid,
    LLMStatusCode,
)

from . import test_sync as base
from .conftest import PEER_CLUSTER, Peer, blocks, start_peer
from .test_sync import assert_same, link, new_sync, peer_call, peer_register, until, zeros

peer = base.peer  # test_sync's fixtures: one peer process per transport (tcp, shm), a linked facade
sdd = base.sdd

DESC = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[64, 4096])  # 4 KiB blocks
S = LLMStatusCode


@contextlib.contextmanager
def loop_held(dd: kvflow.sync.LlmDataDist) -> Iterator[threading.Event]:
    """Hold the facade's loop thread in a callback until the block ends (at most 30 s)."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(30)

    dd._loop.call_soon_threadsafe(hold)
    assert started.wait(10), "the loop thread did not take the holding callback"
    try:
        yield release
    finally:
        release.set()


def warm(dd: kvflow.sync.LlmDataDist, rid: int, cache: kvflow.Cache) -> None:
    """One pull through the loop: the link learns the peer's cache (the fast path needs it known)."""
    dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [0], [0])


def test_small_pull_and_push_run_on_the_calling_thread_over_shm_only(sdd: kvflow.sync.LlmDataDist,
                                                                     peer: Peer) -> None:
    rid = peer_register(peer, DESC, 41)
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    warm(sdd, rid, cache)
    ci = CacheIndex(PEER_CLUSTER, rid)
    if peer.transport == "shm":
        with loop_held(sdd):  # nothing can run on the loop: the copies happen on this thread
            sdd.pull_kv_blocks(ci, cache, [5, 9], [1, 2])
            sdd.pull_kv_cache(CacheIndex(PEER_CLUSTER, rid, 11), cache, 12)  # one 4 KiB slot per tensor
            for a in arrs:
                a[3 * 4096:4 * 4096] = 0xA5
            sdd.push_kv_blocks(cache, ci, [3], [7])
    else:
        done = threading.Event()

        def pull() -> None:
            sdd.pull_kv_blocks(ci, cache, [5, 9], [1, 2])
            sdd.pull_kv_cache(CacheIndex(PEER_CLUSTER, rid, 11), cache, 12)
            sdd.push_kv_blocks(cache, ci, [3], [7])
            done.set()

        for a in arrs:
            a[3 * 4096:4 * 4096] = 0xA5
        with loop_held(sdd):
            worker = threading.Thread(target=pull)
            worker.start()
            assert not done.wait(0.3), "a tcp transfer finished while the loop thread was held"
        worker.join(30)
        assert done.is_set()
    remote = peer_call(peer, "read", rid)
    for t in range(DESC.num_tensors):
        got, want = blocks(arrs[t], DESC), blocks(remote[t], DESC)
        assert np.array_equal(got[[1, 2, 12]], want[[5, 9, 11]])
        assert (want[7] == 0xA5).all()


def test_bad_arguments_raise_typed_errors_on_the_calling_thread(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 42)
    arrs = zeros(DESC)
    cache = sdd.register_kv_cache(DESC, arrs)
    warm(sdd, rid, cache)
    before = [a.copy() for a in arrs]
    ci = CacheIndex(PEER_CLUSTER, rid)
    with loop_held(sdd) if peer.transport == "shm" else contextlib.nullcontext():
        with pytest.raises(LLMParamInvalid, match="block"):
            sdd.pull_kv_blocks(ci, cache, [64], [1])  # the peer's cache has blocks 0..63
        with pytest.raises(LLMParamInvalid):
            sdd.pull_kv_blocks(ci, cache, [1, 2], [1])  # lengths differ
        with pytest.raises(LLMParamInvalid, match="timeout_in_millis"):
            sdd.pull_kv_blocks(ci, cache, [1], [1], timeout_in_millis=0)
    assert_same(arrs, before)


def test_every_caller_thread_transfer_is_counted_once(sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 43)
    cache = sdd.register_kv_cache(DESC, zeros(DESC))
    warm(sdd, rid, cache)
    base = sdd.stats()["ops"]["pull"]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for k in range(200):
                sdd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [(k + w) % 64], [w])
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    ops = sdd.stats()["ops"]["pull"]
    assert ops["transfers"] - base["transfers"] == 800
    assert ops["bytes"] - base["bytes"] == 800 * DESC.num_tensors * 4096
    assert ops["runs"] - base["runs"] == 800 * DESC.num_tensors


class Hammer:
    """Threads that pull block after block into a local cache until stopped (at most 20 s); each
    failure is recorded with the time it was raised."""

    def __init__(self, dd: kvflow.sync.LlmDataDist, rid: int, cache: kvflow.Cache, n: int = 3) -> None:
        self.dd, self.rid, self.cache = dd, rid, cache
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[tuple[float, BaseException]] = []
        self.threads = [threading.Thread(target=self._run, args=(w,)) for w in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, w: int) -> None:
        end = time.monotonic() + 20
        k = 0
        while not self.stop.is_set() and time.monotonic() < end:
            k += 1
            try:
                self.dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, self.rid), self.cache, [k % 64], [k % 64])
                self.ok += 1
            except BaseException as exc:
                self.failures.append((time.monotonic(), exc))
                time.sleep(0.001)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def _unregister_under_pulls(dd: kvflow.sync.LlmDataDist, rid: int) -> None:
    """Register a cache, pull into it from three threads, unregister it; then no byte may land."""
    arrs = zeros(DESC)
    cache = dd.register_kv_cache(DESC, arrs)
    warm(dd, rid, cache)
    hammer = Hammer(dd, rid, cache)
    try:
        assert until(lambda: hammer.ok >= 300), "the pulling threads made no progress"
        dd.unregister_kv_cache(cache.cache_id)
        for a in arrs:
            a[:] = 0  # the memory is ours again: nothing may write into it from now on
        done_at = time.monotonic()
        assert until(lambda: sum(1 for at, _ in hammer.failures if at > done_at) >= 30)
    finally:
        hammer.join()
    for a in arrs:
        assert not a.any(), "a pull wrote into the cache after unregister_kv_cache returned"
    late = [exc for at, exc in hammer.failures if at > done_at]
    assert all(isinstance(e, LLMKvCacheNotExist) for e in late), {type(e).__name__ for e in late}


def test_local_unregister_waits_out_caller_thread_copies_and_none_lands_after(
        sdd: kvflow.sync.LlmDataDist, peer: Peer) -> None:
    rid = peer_register(peer, DESC, 44)
    for _ in range(3):  # three rounds: a race that lands late bytes once in a while shows up
        _unregister_under_pulls(sdd, rid)


def test_peer_unregister_completes_while_caller_threads_pull_from_it(sdd: kvflow.sync.LlmDataDist,
                                                                     peer: Peer) -> None:
    rid = peer_register(peer, DESC, 45)
    cache = sdd.register_kv_cache(DESC, zeros(DESC))
    warm(sdd, rid, cache)
    hammer = Hammer(sdd, rid, cache)
    try:
        assert until(lambda: hammer.ok >= 300), "the pulling threads made no progress"
        peer_call(peer, "unregister", rid)  # over shm it needs our "gone": it raises if we hold it up
        done_at = time.monotonic()
        assert until(lambda: sum(1 for at, _ in hammer.failures if at > done_at) >= 20)
    finally:
        hammer.join()
    late = [exc for at, exc in hammer.failures if at > done_at]
    assert all(isinstance(e, LLMKvCacheNotExist) for e in late), {type(e).__name__ for e in late}


def test_a_dead_peer_fails_caller_thread_pulls_typed_and_breaks_the_link() -> None:
    victim = start_peer("shm")
    killed = False
    try:
        with new_sync(victim) as dd:
            dd.initialize()
            link(dd, victim)
            rid = peer_register(victim, DESC, 46)
            cache = dd.register_kv_cache(DESC, zeros(DESC))
            warm(dd, rid, cache)
            with loop_held(dd):  # the loop cannot see the exit: the copy on this thread meets it first
                os.kill(victim.proc.pid, signal.SIGKILL)
                killed = True
                victim.proc.proc.join(10)
                with pytest.raises(LLMException) as info:
                    dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [1], [1])
                assert info.value.status_code is S.LLM_LINK_FAILED, info.value
            # the failure reached the loop thread-safely and broke the link there
            assert until(lambda: dd.link_info(PEER_CLUSTER).state == "broken")
            with pytest.raises(LLMException) as info:
                dd.pull_kv_blocks(CacheIndex(PEER_CLUSTER, rid), cache, [1], [1])
            assert info.value.status_code is S.LLM_NOT_YET_LINK, info.value
    finally:
        if not killed:
            victim.proc.stop()
