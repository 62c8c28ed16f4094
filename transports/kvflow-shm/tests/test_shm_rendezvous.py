"""The shm rendezvous socket under a link storm: a full backlog is waited out, not a failure."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from typing import Any

import pytest
from conftest import requires_cma

import kvflow_shm

pytestmark = [requires_cma, pytest.mark.asyncio]


class _CountingRandom:
    """``random`` for kvflow_shm that counts the dialer's pauses."""

    def __init__(self) -> None:
        self.pauses = 0

    def uniform(self, lo: float, hi: float) -> float:
        self.pauses += 1
        return random.uniform(lo, hi)


async def _until(pred: Any, what: str) -> None:
    for _ in range(1000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def test_dial_waits_out_a_full_rendezvous_backlog_and_pairs_once_there_is_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvflow_shm, "_MAX_PAIRING", 1)  # one pairing at a time, a backlog of one
    counting = _CountingRandom()
    monkeypatch.setattr(kvflow_shm, "random", counting)
    acceptor, dialer = kvflow_shm._Rendezvous(), kvflow_shm._Rendezvous()
    silent: list[socket.socket] = []
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + acceptor.name)  # takes the only pairing slot and says nothing
        silent.append(s)
        await _until(lambda: acceptor._paused, "the acceptor to stop accepting")
        for _ in range(64):  # fill the kernel's backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect("\0" + acceptor.name)
            except BlockingIOError:
                s.close()
                break
            silent.append(s)
        else:
            raise AssertionError("the backlog never filled")
        binding = os.urandom(32)
        waiting = asyncio.ensure_future(acceptor.wait(binding))
        dialing = asyncio.ensure_future(dialer.dial(acceptor.name, binding))
        await _until(lambda: counting.pauses >= 3, "the dialer to find the backlog full three times")
        assert not dialing.done()
        for s in silent:  # room again: the silent pairing ends, and accepting resumes
            s.close()
        async with asyncio.timeout(10):
            sock = await dialing
            paired = await waiting
        with sock, paired:
            pid, pidfd = (await asyncio.gather(dialer.identify(sock), acceptor.identify(paired)))[0]
            assert pid == os.getpid() and pidfd is None
        assert not acceptor._paused
    finally:
        for s in silent:
            s.close()
        acceptor.close()
        dialer.close()


async def test_dial_to_a_rendezvous_nobody_listens_on_fails_at_once_saying_so() -> None:
    dialer = kvflow_shm._Rendezvous()
    try:
        with pytest.raises(kvflow_shm.LLMLinkFailed, match="cannot reach the peer's rendezvous socket"):
            async with asyncio.timeout(5):
                await dialer.dial(kvflow_shm._UDS_PREFIX + "nobody", os.urandom(32))
    finally:
        dialer.close()
