"""tcp's payload threads (kvflow._pump) and the size of each socket syscall, over real socket pairs.

These use kvflow's own cursors and pool on a ``socket.socketpair`` (a real kernel socket, with no
kvflow peer on the other end) so that the writer can pause at chosen moments. The pool's tests run
with the C socket loop (kvflow._pumpc, built at install) and with the Python one."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.fixture(params=["c", "python"])
def native(request: pytest.FixtureRequest) -> bool:
    """Whether the pool under test moves payloads in the C loop."""
    if request.param == "c" and not pump.NATIVE:
        pytest.fail("kvflow._pumpc was not built: the install needs gcc and the Python headers")
    return bool(request.param == "c")


def test_the_c_socket_loop_is_built_in_this_install() -> None:
    """The developer install compiles kvflow/_pumpc.c (setup.py); without it tcp's threads fall back
    to the Python loop silently, so the suite says so here."""
    assert pump.NATIVE, "kvflow._pumpc is missing: pip install -e . needs gcc and the Python headers"


def test_a_receive_thread_keeps_its_payload_across_a_pause_shorter_than_hold_s(native: bool) -> None:
    """A peer that pauses for 10 ms (five of the old 2 ms give-backs) does not cost a trip back
    to the event loop while no other payload waits for the thread."""
    rx, tx = _pair()
    data = np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    dest = bytearray(len(data))
    job = pump.Job(_Cursor([memoryview(dest)]), len(data))
    pool = pump.Pool(ThreadPoolExecutor(1), native)
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


def test_a_waiting_payload_makes_a_quiet_thread_give_its_own_back(native: bool) -> None:
    """With every thread of the pool on a quiet socket, a new payload still gets a thread soon:
    the holder hands its own back (threads shared by links cannot wait on each other for ever)."""
    rx1, tx1 = _pair()
    rx2, tx2 = _pair()
    dest1, dest2 = bytearray(1 << 20), bytearray(1 << 20)
    job1 = pump.Job(_Cursor([memoryview(dest1)]), len(dest1))
    job2 = pump.Job(_Cursor([memoryview(dest2)]), len(dest2))
    pool = pump.Pool(ThreadPoolExecutor(1), native)
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


def test_a_stalled_socket_gives_the_payload_back_after_hold_s(native: bool) -> None:
    rx, tx = _pair()
    dest = bytearray(1 << 20)
    job = pump.Job(_Cursor([memoryview(dest)]), len(dest))
    pool = pump.Pool(ThreadPoolExecutor(1), native)
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


def _table(sizes: list[int], rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Runs of the given sizes, each in its own array (scattered), and the array of their bytes."""
    runs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return np.concatenate(runs) if runs else np.empty(0, np.uint8), runs


def _cursor_over(kind: str, runs: list[np.ndarray]) -> _Cursor | iov.IovCursor:
    if kind == "views":
        return _Cursor([memoryview(r).cast("B") for r in runs])
    addrs = np.array([r.ctypes.data for r in runs], np.uint64)
    lens = np.array([r.size for r in runs], np.uint64)
    return iov.IovCursor(addrs, lens, CHUNK_BYTES, keep=runs)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 16 << 10, 100_003, 200 << 10]), min_size=1, max_size=24),
       start=st.floats(0, 0.9), kind=st.sampled_from(["views", "iovec"]), sending=st.booleans(),
       native=st.sampled_from([True, False] if pump.NATIVE else [False]))
def test_both_socket_loops_move_scattered_runs_exactly_from_any_start(
        sizes: list[int], start: float, kind: str, sending: bool, native: bool) -> None:
    """From a cursor already part-way (the loop moved the first bytes), a job moves exactly the rest:
    empty runs, runs cut across chunks, sends and receives, in C and in Python."""
    rng = np.random.default_rng(len(sizes))
    whole, runs = _table(sizes, rng)
    if not sending:
        for r in runs:
            r[:] = 0  # the destination
    total = int(whole.size)
    skip = int(total * start)
    cur = _cursor_over(kind, runs)
    cur.advance(skip)
    a, b = _pair()
    pool = pump.Pool(ThreadPoolExecutor(1), native)
    job = pump.Job(cur, total - skip)
    out: list[bytes] = []
    try:
        if sending:
            reader = threading.Thread(target=lambda: out.append(_read_all(b, total - skip)))
            reader.start()
            while job.left:
                pool.send(a, job).result(timeout=30)
            reader.join(30)
            assert out and out[0] == whole[skip:].tobytes()
        else:
            writer = threading.Thread(target=_write_all, args=(b, whole[skip:].tobytes()))
            writer.start()
            while job.left:
                pool.receive(a, job).result(timeout=30)
            writer.join(30)
            got = np.concatenate(runs) if runs else np.empty(0, np.uint8)
            assert got[skip:].tobytes() == whole[skip:].tobytes()
            assert not got[:skip].any(), "a byte landed before the cursor's start"
        assert job.left == 0 and cur.done
    finally:
        job.stop()
        pool.shutdown()
        a.close()
        b.close()


def test_a_stopped_job_writes_no_byte_after_stop_and_counts_exactly_what_it_read(native: bool) -> None:
    """``stop()`` mid-payload: once it returns, bytes still arriving stay in the socket, and the
    cursor and ``left`` say exactly how many landed, so the loop can resume from there."""
    rx, tx = _pair()
    data = np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    sent = 2 << 20  # of a 4 MiB payload: the job cannot finish
    dest = bytearray(len(data))
    cur = _Cursor([memoryview(dest)])
    job = pump.Job(cur, len(data))
    pool = pump.Pool(ThreadPoolExecutor(1), native)
    writer = threading.Thread(target=_write_all, args=(tx, data[:sent]))
    try:
        fut = pool.receive(rx, job)
        writer.start()
        time.sleep(0.02)
        job.stop()
        landed = len(data) - job.left
        assert 0 < landed <= sent and cur.pos == landed
        fut.result(timeout=10)
        time.sleep(0.05)  # the writer goes on meanwhile; a job still reading would take its bytes
        assert not any(dest[landed:]), "a byte landed after stop() returned"
        assert bytes(dest[:landed]) == data[:landed]
        assert _read_all(rx, sent - landed) == data[landed:sent]  # the rest is in the socket, in order
        writer.join(30)
    finally:
        pool.shutdown()
        rx.close()
        tx.close()


@contextlib.contextmanager
def _c_receive(size: int) -> Iterator[tuple[socket.socket, socket.socket, bytearray, pump.Job, Future[None]]]:
    """A C job reading ``size`` bytes from a socket pair: both ends, the destination, the job and
    its future; the job stopped, the pool and sockets closed on the way out."""
    if not pump.NATIVE:
        pytest.fail("kvflow._pumpc was not built")
    rx, tx = _pair()
    dest = bytearray(size)
    job = pump.Job(_Cursor([memoryview(dest)]), len(dest))
    pool = pump.Pool(ThreadPoolExecutor(1), True)
    try:
        yield rx, tx, dest, job, pool.receive(rx, job)
    finally:
        job.stop()
        pool.shutdown()
        rx.close()
        tx.close()


def test_the_c_loop_leaves_the_gil_to_other_threads_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the C loop waits on a quiet socket (``HOLD_S`` raised to 30 s), this thread runs Python
    and sees the job still running; the C loop meanwhile reads the bytes written to it."""
    monkeypatch.setattr(pump, "HOLD_S", 30.0)
    with _c_receive(1 << 20) as (_, tx, dest, job, fut):
        time.sleep(0.05)
        _write_all(tx, b"\x05" * 1000)
        time.sleep(0.05)
        assert not fut.done(), "this thread ran only once the C call had returned: it held the GIL"
        job.stop()
        fut.result(timeout=10)
        assert job.left == len(dest) - 1000 and dest[:1000] == b"\x05" * 1000


def test_a_held_c_job_reads_nothing_until_released() -> None:
    """``hold()`` (the loop thread is about to use the socket): the C loop reads no byte until
    ``release()``, so bytes written meanwhile are the holder's to read; then it goes on."""
    with _c_receive(1 << 20) as (rx, tx, dest, job, fut):
        time.sleep(0.02)
        assert job.native
        job.hold()
        try:
            _write_all(tx, b"\x01" * 1000)
            time.sleep(0.05)
            assert _read_all(rx, 1000) == b"\x01" * 1000, "the held job read bytes meant for the holder"
        finally:
            job.release()
        _write_all(tx, b"\x02" * 1000)
        deadline = time.monotonic() + 10
        while not dest[999] and time.monotonic() < deadline:
            time.sleep(0.001)
        job.stop()
        fut.result(timeout=10)
        assert job.left == len(dest) - 1000 and dest[:1000] == b"\x02" * 1000


def test_a_nudged_c_job_reads_nothing_until_unnudged_even_across_a_hold() -> None:
    """``nudge()`` (the loop thread is about to use the socket the other way): the C loop makes no
    syscall until ``unnudge()``, also after a ``hold()``/``release()`` inside it; then it goes on."""
    with _c_receive(1 << 20) as (rx, tx, dest, job, fut):
        time.sleep(0.02)
        assert job.native
        job.nudge()
        try:
            job.hold()
            job.release()  # the nudge still stands: holds and nudges are counted, not a flag
            _write_all(tx, b"\x03" * 1000)
            time.sleep(0.05)
            assert _read_all(rx, 1000) == b"\x03" * 1000, "the nudged job read bytes meant for the loop thread"
        finally:
            job.unnudge()
        _write_all(tx, b"\x04" * 1000)
        deadline = time.monotonic() + 10
        while not dest[999] and time.monotonic() < deadline:
            time.sleep(0.001)
        job.stop()
        fut.result(timeout=10)
        assert job.left == len(dest) - 1000 and dest[:1000] == b"\x04" * 1000


def test_a_nudge_does_not_wait_for_whoever_holds_the_jobs_lock() -> None:
    """A worker put off its core with the job's lock still held must not keep the loop thread from
    its socket: ``nudge()`` returns while another thread holds the lock, where ``hold()`` waits."""
    with _c_receive(1 << 20) as (_, _tx, _dest, job, fut):
        time.sleep(0.02)
        locked, done = threading.Event(), threading.Event()

        def holder() -> None:
            job.hold()  # the lock, as a worker in its syscall has it
            locked.set()
            done.wait(10)
            job.release()

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert locked.wait(10)
            nudged = threading.Event()

            def nudge() -> None:
                job.nudge()
                nudged.set()
                job.unnudge()

            other = threading.Thread(target=nudge)
            other.start()
            assert nudged.wait(5), "nudge() waited for the job's lock"
            other.join(5)
        finally:
            done.set()
            thread.join(10)
        job.stop()
        fut.result(timeout=10)
