"""Notifications between linked clusters: delivery and order both ways, typed errors, the bounds."""

from __future__ import annotations

import asyncio

import pytest

from kvflow import LlmDataDist, LLMLinkBusy, LLMNotYetLink, LLMParamInvalid, LLMStatusCode
from kvflow import _notes as notes

from .conftest import LOCAL_CLUSTER, PEER_CLUSTER, Pair, status_of

pytestmark = pytest.mark.asyncio


async def _wait_notes(dd: LlmDataDist, n: int) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    for _ in range(500):  # bounded: 5 s
        got += dd.get_notifications()
        if len(got) >= n:
            break
        await asyncio.sleep(0.01)
    return got


async def test_notifications_arrive_in_order_both_ways(pair: Pair) -> None:
    sent = [f"free request {i}".encode() for i in range(50)] + [b"", bytes(range(256)) * 256]
    for p in sent:
        await pair.dd.send_notification(PEER_CLUSTER, p)
    got = await pair.peer.call("notes")
    assert got == [(LOCAL_CLUSTER, p) for p in sent]
    assert await pair.peer.call("notes") == []  # taken once

    await pair.peer.call("notify", LOCAL_CLUSTER, b"blocks of R are yours")
    assert await _wait_notes(pair.dd, 1) == [(PEER_CLUSTER, b"blocks of R are yours")]


async def test_bad_notifications_are_refused_before_sending(pair: Pair) -> None:
    with pytest.raises(LLMParamInvalid, match="exceeds"):
        await pair.dd.send_notification(PEER_CLUSTER, b"x" * (notes.MAX_PAYLOAD + 1))
    with pytest.raises(LLMParamInvalid, match="must be bytes"):
        await pair.dd.send_notification(PEER_CLUSTER, "text")  # type: ignore[arg-type]
    with pytest.raises(LLMNotYetLink):
        await pair.dd.send_notification(99, b"to nobody")
    assert await pair.peer.call("notes") == []


async def test_a_full_inbox_answers_busy_and_keeps_what_it_had(pair: Pair) -> None:
    """The receiving side's bound: here our own inbox, filled by the peer past a lowered limit."""
    inbox = pair.dd._table.inbox
    old = notes.MAX_QUEUED
    notes.MAX_QUEUED = 3
    try:
        for i in range(3):
            await pair.peer.call("notify", LOCAL_CLUSTER, bytes([i]))
        with pytest.raises(LLMLinkBusy) as info:
            await pair.peer.call("notify", LOCAL_CLUSTER, b"one too many")
        assert status_of(info.value) == LLMStatusCode.LLM_LINK_BUSY
        assert len(inbox) == 3
        assert pair.dd.get_notifications() == [(PEER_CLUSTER, bytes([i])) for i in range(3)]
        await pair.peer.call("notify", LOCAL_CLUSTER, b"room again")
        assert await _wait_notes(pair.dd, 1) == [(PEER_CLUSTER, b"room again")]
    finally:
        notes.MAX_QUEUED = old
