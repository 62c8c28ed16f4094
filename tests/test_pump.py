"""tcp's payload threads (kvflow._pump) and the size of each socket syscall, over real socket pairs.

These use kvflow's own cursors and pool on a ``socket.socketpair`` (a real kernel socket, with no
kvflow peer on the other end) so that the writer can pause at chosen moments."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvflow import _iov as iov
from kvflow import _pump as pump
from kvflow._tcp import CHUNK_BYTES, _Cursor


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def _write_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            time.sleep(0.0005)
            continue
        view = view[n:]


def test_a_receive_thread_keeps_its_payload_across_a_pause_shorter_than_hold_s() -> None:
    """A peer that pauses for 10 ms (five of the old 2 ms give-backs) does not cost a trip back
    to the event loop while no other payload waits for the thread."""
    rx, tx = _pair()
    data = np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    dest = bytearray(len(data))
    job = pump.Job(_Cursor([memoryview(dest)]), len(data))
    pool = pump.Pool(ThreadPoolExecutor(1))
    try:
        fut = pool.receive(rx, job)
        _write_all(tx, data[: 1 << 20])
        time.sleep(0.01)
        assert not fut.done(), "the thread gave the payload back during a 10 ms pause"
        _write_all(tx, data[1 << 20 :])
        fut.result(timeout=10)
        assert job.left == 0 and bytes(dest) == data
    finally:
        job.stop()
        pool.shutdown()
        rx.close()
        tx.close()


def test_a_waiting_payload_makes_a_quiet_thread_give_its_own_back() -> None:
    """With every thread of the pool on a quiet socket, a new payload still gets a thread soon:
    the holder hands its own back (threads shared by links cannot wait on each other for ever)."""
    rx1, tx1 = _pair()
    rx2, tx2 = _pair()
    dest1, dest2 = bytearray(1 << 20), bytearray(1 << 20)
    job1 = pump.Job(_Cursor([memoryview(dest1)]), len(dest1))
    job2 = pump.Job(_Cursor([memoryview(dest2)]), len(dest2))
    pool = pump.Pool(ThreadPoolExecutor(1))
    try:
        fut1 = pool.receive(rx1, job1)  # nothing is ever written to tx1: its socket stays quiet
        time.sleep(0.01)
        assert not fut1.done()
        fut2 = pool.receive(rx2, job2)
        fut1.result(timeout=pump.HOLD_S / 2)  # well before HOLD_S: it went because job2 waited
        assert job1.left == len(dest1)
        _write_all(tx2, b"\x07" * len(dest2))
        fut2.result(timeout=10)
        assert job2.left == 0 and dest2 == b"\x07" * len(dest2)
    finally:
        job1.stop()
        job2.stop()
        pool.shutdown()
        for s in (rx1, tx1, rx2, tx2):
            s.close()


def test_a_stalled_socket_gives_the_payload_back_after_hold_s() -> None:
    rx, tx = _pair()
    dest = bytearray(1 << 20)
    job = pump.Job(_Cursor([memoryview(dest)]), len(dest))
    pool = pump.Pool(ThreadPoolExecutor(1))
    try:
        t0 = time.perf_counter()
        pool.receive(rx, job).result(timeout=10)
        assert time.perf_counter() - t0 >= pump.HOLD_S
        assert job.left == len(dest)
    finally:
        pool.shutdown()
        rx.close()
        tx.close()


def _read_all(sock: socket.socket, total: int) -> bytes:
    got = bytearray()
    while len(got) < total:
        try:
            chunk = sock.recv(total - len(got))
        except BlockingIOError:
            time.sleep(0.0005)
            continue
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("cursor", ["views", "iovec"])
def test_no_syscall_moves_more_than_chunk_bytes_and_the_bytes_stay_exact(cursor: str) -> None:
    """A 4 MiB buffer goes out in sends of at most CHUNK_BYTES: a longer one holds a core in the
    kernel's softirq path, where a waking event loop cannot preempt it."""
    if cursor == "iovec" and not iov.AVAILABLE:
        pytest.skip("the iovec path needs libc's readv/sendmsg through ctypes")
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    lens = np.array([3 << 20, 1 << 20], dtype=np.uint64)  # runs longer than a chunk, one cut twice
    addrs = np.array([src.ctypes.data, src.ctypes.data + (3 << 20)], dtype=np.uint64)
    cur: _Cursor | iov.IovCursor
    if cursor == "views":
        cur = _Cursor([memoryview(src[: 3 << 20]).cast("B"), memoryview(src[3 << 20 :]).cast("B")])
    else:
        cur = iov.IovCursor(addrs, lens, CHUNK_BYTES)
    tx, rx = _pair()
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(_read_all(rx, src.nbytes)))
    reader.start()
    offered: list[int] = []
    try:
        while not cur.done:
            try:
                n, want = cur.send(tx)
            except BlockingIOError:
                time.sleep(0.0005)
                continue
            offered.append(want)
            assert 0 < n <= want <= CHUNK_BYTES
            cur.advance(n)
        reader.join(30)
        assert out and out[0] == src.tobytes()
        assert max(offered) == CHUNK_BYTES
    finally:
        tx.close()
        rx.close()
