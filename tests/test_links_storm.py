"""Link storms: many dialers at once against one listener, a listener at its bounds, and what a
dialer is told when it cannot link (issue 15)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import pytest
import pytest_asyncio

import kvflow._listener as listener
from kvflow import (
    ClusterInfo,
    IpInfo,
    LinkResults,
    LlmDataDist,
    LLMLinkBusy,
    LLMLinkFailed,
    LLMParamInvalid,
    LlmRole,
    LLMStatusCode,
)
from kvflow import _wire as wire
from kvflow._bench_links import run_bench_links
from kvflow._status import RETRYABLE_CODES
from kvflow.testing import inspect

pytestmark = pytest.mark.asyncio

TCP = {"kvflow.Transports": "tcp"}
SRV = 1
RAW_ERRORS = ("bytes read", "expected bytes", "struct", "Errno")  # what a link failure must never say


@pytest_asyncio.fixture
async def srv() -> AsyncIterator[LlmDataDist]:
    """A listening LlmDataDist (cluster 1) in this process."""
    dd = LlmDataDist(SRV, LlmRole.PROMPT)
    await dd.initialize({**TCP, "llm.ListenIpInfo": "127.0.0.1:0", "kvflow.HeartbeatTimeout": "10000"})
    yield dd
    await dd.finalize()


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Raw connections a test holds open against a listener; closed at the end."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


async def dial(cluster: int, address: tuple[str, int], timeout_ms: int) -> tuple[LLMStatusCode, float]:
    """Link a fresh LlmDataDist ``cluster`` to ``address``: its status and the seconds it took."""
    async with LlmDataDist(cluster, LlmRole.DECODER, options=TCP) as dd:
        t0 = time.monotonic()
        (code,) = await dd.link_llm_clusters([ClusterInfo(SRV, [IpInfo(*address)])], timeout_ms)
        return code, time.monotonic() - t0


async def until(pred: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def hold_handshakes(dd: LlmDataDist, n: int, held: list[socket.socket]) -> None:
    """Open ``n`` control connections that send the magic and then nothing: they fill handshake slots."""
    assert dd.listen_address is not None
    for _ in range(n):
        s = socket.create_connection(dd.listen_address)
        s.sendall(wire.MAGIC_CONTROL)
        held.append(s)
    await until(lambda: inspect.control_handshakes(dd) == n, f"{n} held handshakes")


def failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.kvflow["error"] for r in caplog.records if getattr(r, "kvflow_event", None) == "link_failed"]


# ------------------------------------------------------------------ the storm, in real processes
@pytest.mark.timeout(150)
@pytest.mark.parametrize("timeout_ms", [20_000, 300])
async def test_1024_concurrent_links_to_one_listener_succeed_or_fail_retryable_at_their_timeout(
        timeout_ms: int) -> None:
    """1024 instances in 4 processes link to one listener at the same moment. Each link succeeds, or
    fails no sooner than its timeout with a retryable status whose message says why in words. With
    20 s each, all link; with 300 ms, the listener cannot take them all in time."""
    res = await run_bench_links(1024, 4, timeout_ms, 0.0, TCP)
    outcomes = res["codes_and_times"]
    assert len(outcomes) == 1024
    for code, took in outcomes:
        if code != LLMStatusCode.LLM_SUCCESS:
            assert LLMStatusCode(code) in RETRYABLE_CODES, LLMStatusCode(code).name
            assert took >= timeout_ms / 1000 - 0.01, took
    assert res["held_by_listener"] == res["linked"]
    assert not [e for e in res["errors"] if any(raw in e for raw in RAW_ERRORS)], res["errors"]
    if timeout_ms == 20_000:
        assert res["linked"] == 1024, res["failed"]
    else:
        assert res["failed"], "the short timeout was meant to leave some links failed"


def _shm_unavailable() -> str | None:
    try:
        from kvflow_shm import ShmTransport
    except ImportError:
        return "kvflow-shm is not installed"
    return ShmTransport.unavailable_reason()


@pytest.mark.timeout(150)
@pytest.mark.skipif(_shm_unavailable() is not None, reason=f"shm unavailable: {_shm_unavailable()}")
@pytest.mark.parametrize("timeout_ms", [20_000, 300])
async def test_512_concurrent_shm_links_to_one_listener_succeed_or_fail_retryable_at_their_timeout(
        timeout_ms: int) -> None:
    """The same storm pinned to shm, whose links also meet on the listener's rendezvous socket: its
    backlog once let 734 of 1024 fail with "cannot reach the peer's rendezvous socket"."""
    res = await run_bench_links(512, 4, timeout_ms, 0.0, {"kvflow.Transports": "shm"})
    outcomes = res["codes_and_times"]
    assert len(outcomes) == 512
    for code, took in outcomes:
        if code != LLMStatusCode.LLM_SUCCESS:
            assert LLMStatusCode(code) in RETRYABLE_CODES, (LLMStatusCode(code).name, res["errors"])
            assert took >= timeout_ms / 1000 - 0.01, took
    assert res["held_by_listener"] == res["linked"]
    assert not [e for e in res["errors"] if "rendezvous" in e or any(raw in e for raw in RAW_ERRORS)], res["errors"]
    if timeout_ms == 20_000:
        assert res["linked"] == 512, (res["failed"], res["errors"])


# ------------------------------------------------------------------ the listener's bounds
async def test_listener_at_its_handshake_bound_answers_busy_and_hangs_up_cleanly(
        srv: LlmDataDist, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "MAX_HANDSHAKES", 2)
    await hold_handshakes(srv, 2, held)
    assert srv.listen_address is not None

    def knock() -> tuple[dict[str, Any], bytes]:
        with socket.create_connection(srv.listen_address, timeout=5) as s:
            s.sendall(wire.MAGIC_CONTROL + wire.pack({"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": 7,
                                                      "expect": SRV, "instance": "x", "auth": False,
                                                      "cnonce": b"n" * 32, "transports": ["tcp"]}))
            data = b""
            while chunk := s.recv(65536):  # a reset here would raise: the answer must end in a clean close
                data += chunk
        (n,) = wire._LEN.unpack(data[:4])
        return msgpack.unpackb(data[4:4 + n]), data[4 + n:]

    answer, rest = await asyncio.to_thread(knock)
    assert answer["t"] == "reject" and answer["code"] == LLMStatusCode.LLM_LINK_BUSY, answer
    assert set(answer) == {"t", "code", "msg"} and "busy" in answer["msg"]  # nothing but the refusal
    assert rest == b""
    assert inspect.busy_answers(srv) == 1 and SRV not in inspect.links(srv)


async def test_link_retries_a_busy_listener_and_links_once_it_has_room(
        srv: LlmDataDist, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "MAX_HANDSHAKES", 1)
    await hold_handshakes(srv, 1, held)
    assert srv.listen_address is not None
    linking = asyncio.ensure_future(dial(20, srv.listen_address, 5000))
    await until(lambda: inspect.busy_answers(srv) >= 2, "two busy answers")
    held.pop().close()  # room for one handshake
    code, took = await linking
    assert code == LLMStatusCode.LLM_SUCCESS
    assert inspect.busy_answers(srv) >= 2 and took < 4.0


async def test_link_to_a_listener_busy_past_the_timeout_is_link_busy_saying_so(
        srv: LlmDataDist, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(listener, "MAX_HANDSHAKES", 1)
    await hold_handshakes(srv, 1, held)
    assert srv.listen_address is not None
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        code, took = await dial(21, srv.listen_address, 600)
    assert code == LLMStatusCode.LLM_LINK_BUSY and code in RETRYABLE_CODES
    assert 0.59 < took < 2.0, took
    (why,) = failures(caplog)
    assert "listener backlog full" in why and "retried" in why, why
    assert not any(raw in why for raw in RAW_ERRORS), why
    assert inspect.busy_answers(srv) >= 2


async def test_link_results_give_the_caller_each_failed_clusters_exception_saying_what_happened(
        srv: LlmDataDist, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the log: ``link_llm_clusters``' result carries, per cluster that did not link, the
    typed exception with the same words."""
    monkeypatch.setattr(listener, "MAX_HANDSHAKES", 1)
    await hold_handshakes(srv, 1, held)
    assert srv.listen_address is not None
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    busy, nobody, me = (ClusterInfo(SRV, [IpInfo(*srv.listen_address)]), ClusterInfo(26, [IpInfo("127.0.0.1", port)]),
                        ClusterInfo(25, [IpInfo("127.0.0.1", port)]))
    async with LlmDataDist(25, LlmRole.DECODER, options=TCP) as dd:
        rets = await dd.link_llm_clusters([busy, nobody, me], 600)
        assert isinstance(rets, LinkResults) and isinstance(rets, list)
        assert rets == [LLMStatusCode.LLM_LINK_BUSY, LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_PARAM_INVALID]
        assert set(rets.errors) == {SRV, 26, 25}
        err = rets.errors[SRV]
        assert isinstance(err, LLMLinkBusy) and err.status_code == LLMStatusCode.LLM_LINK_BUSY
        assert "listener backlog full" in str(err) and "retried" in str(err) and "until the timeout" in str(err), err
        assert not any(raw in str(err) for raw in RAW_ERRORS), err
        err = rets.errors[26]
        assert isinstance(err, LLMLinkFailed) and f"connection refused by 127.0.0.1:{port}" in str(err), err
        err = rets.errors[25]
        assert isinstance(err, LLMParamInvalid) and "to itself" in str(err), err

        held.pop().close()  # room for one handshake
        rets = await dd.link_llm_clusters([busy], 5000)
        assert rets == [LLMStatusCode.LLM_SUCCESS] and rets.errors == {}
        rets = await dd.link_llm_clusters([busy], 5000)
        assert rets == [LLMStatusCode.LLM_ALREADY_LINK] and "healthy link to cluster 1" in str(rets.errors[SRV])


async def test_link_retries_a_listener_that_resets_connections_beyond_its_bound(
        srv: LlmDataDist, held: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "MAX_CONNECTIONS", 2)  # a tcp link needs two: control and data
    assert srv.listen_address is not None
    held.extend(socket.create_connection(srv.listen_address) for _ in range(2))  # silent: fill both slots
    await until(lambda: inspect.handshakes(srv) == 2, "the held connections")
    linking = asyncio.ensure_future(dial(22, srv.listen_address, 5000))
    await asyncio.sleep(0.3)
    assert not linking.done()  # reset, retried, reset ...
    while held:
        held.pop().close()
    code, took = await linking
    assert code == LLMStatusCode.LLM_SUCCESS and took >= 0.3


async def test_link_retries_when_the_listener_gives_up_on_a_slow_handshake(
        dds_srv_slow: tuple[LlmDataDist, list[int]]) -> None:
    srv, calls = dds_srv_slow  # its first handshake stalls past the listener's 1 s
    assert srv.listen_address is not None
    code, took = await dial(24, srv.listen_address, 5000)
    assert code == LLMStatusCode.LLM_SUCCESS and took >= 1.0, (code, took)
    assert len(calls) == 2  # the stalled handshake, then the one that linked


@pytest_asyncio.fixture
async def dds_srv_slow(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[LlmDataDist, list[int]]]:
    """A listener (handshake timeout 1 s) whose first handshake sleeps 1.5 s before it starts."""
    calls: list[int] = []
    accept = listener.handshake.accept

    async def slow_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(1.5)
        return await accept(*args, **kwargs)

    monkeypatch.setattr(listener.handshake, "accept", slow_once)
    dd = LlmDataDist(SRV, LlmRole.PROMPT)
    await dd.initialize({**TCP, "llm.ListenIpInfo": "127.0.0.1:0", "kvflow.HeartbeatInterval": "200",
                         "kvflow.HeartbeatTimeout": "1000"})
    yield dd, calls
    await dd.finalize()


async def test_refused_link_is_retried_briefly_then_fails_saying_nothing_listens(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        code, took = await dial(23, ("127.0.0.1", port), 5000)
    assert code == LLMStatusCode.LLM_LINK_FAILED and took < 1.0, took
    (why,) = failures(caplog)
    assert f"connection refused by 127.0.0.1:{port}" in why and "nothing listens there" in why, why
    assert "3 times" in why, why  # the first try and REFUSED_RETRIES more
