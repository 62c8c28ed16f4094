"""The native layer between two real processes: reads, writes, batching, and every error path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _peer import PAGE, addr_of
from conftest import Peer, requires_cma
from kvflow import LLMKvCacheNotExist, LLMLinkFailed, LLMParamInvalid

from kvflow_shm import _lowlevel as ll

pytestmark = requires_cma


def _u64(*vals: object) -> np.ndarray:
    return np.array(vals, dtype=np.uint64)


def test_read_scattered_blocks(peer: Peer) -> None:
    want = np.frombuffer(peer.contents(), dtype=np.uint8)
    block = 4096
    nblk = peer.nbytes // block
    order = np.random.default_rng(3).permutation(nblk)
    dst = np.zeros(peer.nbytes, dtype=np.uint8)
    local = addr_of(dst) + np.arange(nblk, dtype=np.uint64) * np.uint64(block)
    remote = np.uint64(peer.addr) + order.astype(np.uint64) * np.uint64(block)
    lens = np.full(nblk, block, dtype=np.uint64)
    assert ll.vm_copy(peer.pid, False, local, remote, lens) == peer.nbytes
    assert np.array_equal(dst.reshape(nblk, block), want.reshape(nblk, block)[order])


def test_write_then_read_back(peer: Peer) -> None:
    src = np.random.default_rng(5).integers(0, 256, peer.nbytes, dtype=np.uint8)
    # more runs than IOV_MAX, of odd sizes, so the C loop must chunk and resume mid-array
    cuts = np.unique(np.random.default_rng(6).integers(1, peer.nbytes, 3 * ll.IOV_MAX))
    starts = np.concatenate(([0], cuts)).astype(np.uint64)
    lens = np.diff(np.concatenate((starts, [peer.nbytes]))).astype(np.uint64)
    assert lens.size > 2 * ll.IOV_MAX
    n = ll.vm_copy(peer.pid, True, addr_of(src) + starts, np.uint64(peer.addr) + starts, lens)
    assert n == peer.nbytes
    assert peer.contents() == src.tobytes()


def test_runs_longer_than_a_chunk_are_split(peer: Peer) -> None:
    want = peer.contents()
    dst = np.zeros(peer.nbytes + 2 * PAGE, dtype=np.uint8)  # guard bytes after the copy
    n = ll.vm_copy(peer.pid, False, _u64(addr_of(dst)), _u64(peer.addr), _u64(peer.nbytes), max_chunk=12345)
    assert n == peer.nbytes
    assert dst[: peer.nbytes].tobytes() == want
    assert not dst[peer.nbytes :].any()


def test_partial_transfer_is_an_error(peer: Peer) -> None:
    # the peer's guard map: page 0 readable, page 1 PROT_NONE -> the kernel stops after one page
    dst = np.zeros(2 * PAGE, dtype=np.uint8)
    with pytest.raises(LLMKvCacheNotExist, match=f"EFAULT after {PAGE} of {2 * PAGE} bytes"):
        ll.vm_copy(peer.pid, False, _u64(addr_of(dst)), _u64(peer.info["guard"]), _u64(2 * PAGE))


def test_unmapped_remote_is_an_error(peer: Peer) -> None:
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(LLMKvCacheNotExist, match="EFAULT after 0 of 64"):
        ll.vm_copy(peer.pid, False, _u64(addr_of(dst)), _u64(peer.info["guard"] + PAGE), _u64(64))


def test_dead_peer_is_link_failed() -> None:
    p = Peer()
    pid = p.pid
    p.stop()
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(LLMLinkFailed, match="ESRCH"):
        ll.vm_copy(pid, False, _u64(addr_of(dst)), _u64(p.addr), _u64(64))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_other_uid_is_denied(peer: Peer) -> None:
    mine = np.arange(64, dtype=np.uint8)
    assert peer.call("setuid", 65534) is True
    exc = peer.call("read", os.getpid(), addr_of(mine), 64)
    assert isinstance(exc, LLMLinkFailed)
    assert "EPERM" in str(exc) and "ptrace" in str(exc)


def test_stop_flag_stops_before_any_byte(peer: Peer) -> None:
    stop = ll.StopFlag()
    stop.set()
    dst = np.zeros(peer.nbytes, dtype=np.uint8)
    with pytest.raises(ll.CopyStopped) as info:
        ll.vm_copy(peer.pid, False, _u64(addr_of(dst)), _u64(peer.addr), _u64(peer.nbytes), stop=stop)
    assert info.value.done == 0
    assert not dst.any()


def test_mismatched_arrays_are_rejected(peer: Peer) -> None:
    with pytest.raises(LLMParamInvalid):
        ll.vm_copy(peer.pid, False, _u64(1, 2), _u64(1), _u64(1))


def _bad_run(local: np.ndarray, lens: np.ndarray, tensor: np.ndarray, bases: np.ndarray,
             sizes: np.ndarray) -> tuple[str, int] | None:
    """Which run ``transfer`` refuses (side, index), checking the runs as local and as remote runs."""
    regions = ll.Regions(bases, sizes)
    found = []
    for side in ("local", "remote"):
        lr, rr = (regions, None) if side == "local" else (None, regions)
        try:
            ll.transfer(os.getpid(), False, local, local, lens, tensor, tensor, lr, rr, inline_limit=0)
        except ll.RunOutOfBounds as exc:
            assert exc.side == side
            found.append((side, exc.index))
    assert len(found) in (0, 2) and (not found or found[0][1] == found[1][1])
    return found[0] if found else None


def test_runs_are_checked_against_regions() -> None:
    bases, sizes = _u64(1000, 5000), _u64(100, 50)
    t = np.array([0, 1, 0], dtype=np.int64)
    # inline_limit=0: checked runs are deferred, so no byte moves even for these made-up addresses
    assert _bad_run(_u64(1000, 5000, 1050), _u64(100, 50, 50), t, bases, sizes) is None
    assert _bad_run(_u64(1000, 5000, 1051), _u64(100, 50, 50), t, bases, sizes) == ("local", 2)
    assert _bad_run(_u64(1000, 4999, 1000), _u64(1, 1, 1), t, bases, sizes) == ("local", 1)
    assert _bad_run(_u64(1000, 5000, 1000), _u64(1, 0, 1), t, bases, sizes) == ("local", 1)  # empty run
    one = np.zeros(1, dtype=np.int64)
    assert _bad_run(_u64(1000), _u64(2**64 - 1), one, bases, sizes) == ("local", 0)  # overflow
    assert _bad_run(_u64(1000), _u64(1), one + 2, bases, sizes) == ("local", 0)  # no such tensor
    assert _bad_run(_u64(1000), _u64(1), one - 1, bases, sizes) == ("local", 0)


def test_checked_transfer_moves_bytes_and_defers_big_batches() -> None:
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    t = np.zeros(2, dtype=np.int64)
    lr, rr = ll.Regions(_u64(addr_of(dst)), _u64(256)), ll.Regions(_u64(addr_of(src)), _u64(256))
    local, remote, lens = addr_of(dst) + _u64(0, 100), addr_of(src) + _u64(200, 0), _u64(50, 100)
    assert ll.transfer(os.getpid(), False, local, remote, lens, t, t, lr, rr, inline_limit=149) == -150
    assert not dst.any()
    assert ll.transfer(os.getpid(), False, local, remote, lens, t, t, lr, rr, inline_limit=150) == 150
    assert np.array_equal(dst[:50], src[200:250]) and np.array_equal(dst[100:200], src[:100])
    # any integer dtype and non-contiguous arrays are accepted
    wide = np.stack([local.astype(np.int64), local.astype(np.int64)], axis=1)[:, 0]
    assert ll.transfer(os.getpid(), False, wide, remote, lens.astype(np.int32), t, t, lr, rr) == 150


def test_table_transfer_checks_runs_then_moves_or_defers() -> None:
    """``transfer_table``: the (5, n) RunBatch table in one buffer, same checks as ``transfer``."""
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    lr, rr = ll.Regions(_u64(addr_of(dst)), _u64(256)), ll.Regions(_u64(addr_of(src)), _u64(256))
    out = ll.scratch()

    def table(local: list[int], remote: list[int], lens: list[int], rt: int = 0) -> np.ndarray:
        n = len(lens)
        return np.array([[addr_of(dst) + o for o in local], [addr_of(src) + o for o in remote], lens, [0] * n,
                         [rt] * n], dtype=np.uint64)

    assert ll.transfer_table(os.getpid(), False, table([0, 100], [200, 0], [50, 100]), lr, rr, 149, out) == -150
    assert not dst.any()
    assert ll.transfer_table(os.getpid(), False, table([0, 100], [200, 0], [50, 100]), lr, rr, 150, out) == 150
    assert np.array_equal(dst[:50], src[200:250]) and np.array_equal(dst[100:200], src[:100])
    dst[:] = 0
    for bad, side in [(table([0, 250], [0, 0], [10, 10]), "local"), (table([0], [250], [10]), "remote"),
                      (table([0], [0], [10], rt=1), "remote")]:
        with pytest.raises(ll.RunOutOfBounds) as info:
            ll.transfer_table(os.getpid(), False, bad, lr, rr, 1 << 20, out)
        assert info.value.side == side
    assert not dst.any()  # a refused batch moves nothing
    # another dtype or a non-contiguous view is copied first; a wrong shape is refused
    assert ll.transfer_table(os.getpid(), False, table([0], [5], [5]).astype(np.int64), lr, rr, 1 << 20, out) == 5
    wide = np.repeat(table([8], [9], [3]), 2, axis=1)[:, ::2]
    assert not wide.flags.c_contiguous
    assert ll.transfer_table(os.getpid(), False, wide, lr, rr, 1 << 20, out) == 3
    assert dst[:5].tolist() == [5, 6, 7, 8, 9] and dst[8:11].tolist() == [9, 10, 11]
    for shape in [(4, 1), (5, 0), (5,)]:
        with pytest.raises(LLMParamInvalid):
            ll.transfer_table(os.getpid(), False, np.zeros(shape, dtype=np.uint64), lr, rr, 1 << 20, out)


def test_import_without_native_module() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["kvflow_shm._native"] = None  # as if the build step never ran
        import kvflow_shm
        reason = kvflow_shm.ShmTransport.unavailable_reason()
        assert reason and reason.startswith("kvflow_shm native module not built"), reason
        print(reason)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "not built" in out.stdout


def test_disable_switch() -> None:
    code = "import kvflow_shm; print(kvflow_shm.ShmTransport.unavailable_reason())"
    env = dict(os.environ, KVFLOW_SHM_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("disabled by KVFLOW_SHM_DISABLE")
