"""Heartbeats: what an idle link sends, one timer for every link of a loop, peers with other
settings and peers that want pongs (kvflow/_heartbeat.py). The bound itself (a silent peer breaks
the link at its timeout) is tested in tests/test_reliability.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import pytest_asyncio

import kvflow._heartbeat as hb
import kvflow._link as link_mod
from kvflow import ClusterInfo, IpInfo, LlmDataDist, LLMKvCacheNotExist, LLMParamInvalid, LlmRole, LLMStatusCode
from kvflow._options import parse_options
from kvflow.testing import inspect

from ._relpeer import RawClient

pytestmark = pytest.mark.asyncio

SRV = 1
FAST = {"kvflow.Transports": "tcp", "kvflow.HeartbeatInterval": "100", "kvflow.HeartbeatTimeout": "1000"}


@pytest_asyncio.fixture
async def dds() -> AsyncIterator[list[LlmDataDist]]:
    """LlmDataDists a test makes; finalized at the end."""
    made: list[LlmDataDist] = []
    yield made
    for dd in reversed(made):
        await dd.finalize()


async def make(made: list[LlmDataDist], cluster: int, listen: bool = False, **opts: str) -> LlmDataDist:
    dd = LlmDataDist(cluster, LlmRole.PROMPT if listen else LlmRole.DECODER)
    await dd.initialize({**FAST, **({"llm.ListenIpInfo": "127.0.0.1:0"} if listen else {}), **opts})
    made.append(dd)
    return dd


async def link(dd: LlmDataDist, srv: LlmDataDist) -> None:
    assert srv.listen_address is not None
    (code,) = await dd.link_llm_clusters([ClusterInfo(SRV, [IpInfo(*srv.listen_address)])], 5000)
    assert code == LLMStatusCode.LLM_SUCCESS


def count_frames(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[int, str]]:
    """Control frames sent from now on, by (peer cluster of the sending link, frame type)."""
    sent: Counter[tuple[int, str]] = Counter()
    original = link_mod.Link.send

    def send(self: link_mod.Link, msg: dict[str, Any] | bytes) -> None:
        kind = msgpack.unpackb(msg[4:])["t"] if isinstance(msg, bytes) else msg["t"]
        sent[(self.remote_cluster_id, kind)] += 1
        original(self, msg)

    monkeypatch.setattr(link_mod.Link, "send", send)
    return sent


async def test_idle_link_carries_one_ping_each_way_per_interval_and_no_pongs(
        dds: list[LlmDataDist], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = await make(dds, SRV, listen=True)
    cli = await make(dds, 2)
    await link(cli, srv)
    sent = count_frames(monkeypatch)
    await asyncio.sleep(1.0)  # interval 100 ms, visits up to 25 ms late: 8 to 10 pings each way (fewer if slow)
    assert 5 <= sent[(SRV, "ping")] <= 11, sent  # the client's link to the server
    assert 5 <= sent[(2, "ping")] <= 11, sent  # the server's link to the client
    assert sent[(SRV, "pong")] == sent[(2, "pong")] == 0, sent
    assert inspect.link(cli, SRV).healthy and inspect.link(srv, 2).healthy


async def test_a_busy_link_sends_no_pings(dds: list[LlmDataDist], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = await make(dds, SRV, listen=True)
    cli = await make(dds, 2)
    await link(cli, srv)
    sent = count_frames(monkeypatch)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # a control request every 20 ms: the link is never silent for 100 ms
        with pytest.raises(LLMKvCacheNotExist):
            await inspect.link(cli, SRV).request({"op": "cache", "cache_id": 99}, 1.0)
        await asyncio.sleep(0.02)
    assert sent[(SRV, "ping")] == sent[(2, "ping")] == 0, sent  # requests one way, answers the other


async def test_links_of_one_loop_share_one_heartbeat_timer(dds: list[LlmDataDist]) -> None:
    srv = await make(dds, SRV, listen=True)
    clients = [await make(dds, 10 + i) for i in range(20)]
    await asyncio.gather(*(link(c, srv) for c in clients))
    walker = hb.heartbeats()
    assert len(walker) == 40  # both ends of 20 links, all on this loop
    loop = asyncio.get_running_loop()
    fires = [h for h in getattr(loop, "_scheduled", []) if getattr(h, "_callback", None) == walker._fire
             and not h.cancelled()]
    assert len(fires) == 1, fires
    visits = walker.visits
    await asyncio.sleep(0.5)
    assert 40 * 2 <= walker.visits - visits <= 40 * 6  # about one visit per link per 100 ms, not one per walk
    assert all(inspect.link(c, SRV).healthy for c in clients)


async def test_link_between_sides_with_other_heartbeat_settings_stays_up(dds: list[LlmDataDist]) -> None:
    """Both sides ping at the shorter interval: each hears from the other as often as it asked."""
    srv = await make(dds, SRV, listen=True, **{"kvflow.HeartbeatInterval": "50", "kvflow.HeartbeatTimeout": "200"})
    cli = await make(dds, 2, **{"kvflow.HeartbeatInterval": "2000", "kvflow.HeartbeatTimeout": "5000"})
    await link(cli, srv)
    await asyncio.sleep(1.0)  # five of the server's timeouts
    assert inspect.link(cli, SRV).healthy and inspect.link(srv, 2).healthy


async def test_a_peer_that_does_not_say_its_settings_gets_a_pong_for_each_ping(dds: list[LlmDataDist]) -> None:
    srv = await make(dds, SRV, listen=True)
    assert srv.listen_address is not None
    c = RawClient(srv.listen_address)
    try:
        welcome = await asyncio.to_thread(c.handshake, 7, SRV)  # an older kvflow: its choice has no "hb"
        assert welcome["hb"] == [100, 1000]  # the server says its interval and timeout
        await until(lambda: 7 in inspect.links(srv) and inspect.link(srv, 7).healthy)

        def ping_and_listen() -> Counter[str]:
            c.send_msg({"t": "ping"})
            seen: Counter[str] = Counter()
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                msg = c.recv_msg(answer_pings=False)
                assert msg is not None
                seen[msg["t"]] += 1
                if msg["t"] == "ping":
                    c.send_msg({"t": "pong"})
            return seen

        seen = await asyncio.to_thread(ping_and_listen)
        assert seen["pong"] == 1 and seen["ping"] >= 3, seen
    finally:
        c.close()


async def until(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("said", [
    [0, 1000], [5, 1000], [100, 100], [1000, 100], [100, 600_001], [-1, 1000],  # outside the bounds
    [100.0, 1000], [True, 1000], ["100", "1000"], [100], [100, 1000, 5], {"interval": 100}, None,  # ill-formed
])
async def test_a_peers_heartbeat_settings_outside_the_bounds_are_ignored(said: Any) -> None:
    # a hostile peer cannot make this side ping in a tight loop or never time it out: it gets pongs,
    # and our own settings rule
    from kvflow._handshake import MAX_HEARTBEAT_MS, MIN_HEARTBEAT_MS, heartbeat_settings

    assert MIN_HEARTBEAT_MS >= 10 and MAX_HEARTBEAT_MS <= 600_000
    assert heartbeat_settings({"hb": said}) is None
    assert heartbeat_settings({"hb": [MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS]}) == (MIN_HEARTBEAT_MS / 1000,
                                                                                MAX_HEARTBEAT_MS / 1000)


@pytest.mark.parametrize(("given", "interval", "timeout"), [
    ({}, 666, 2000),  # the defaults: 1024 idle links cost a listener about 1.6 % of a core
    ({"kvflow.HeartbeatTimeout": "600"}, 200, 600),  # a timeout alone: a third of it
    ({"kvflow.HeartbeatTimeout": "10000"}, 1000, 10000),  # ... at most 1 s
    ({"kvflow.HeartbeatInterval": "250"}, 250, 2000),
])
async def test_heartbeat_defaults_and_a_timeout_given_alone(given: dict[str, str], interval: int,
                                                            timeout: int) -> None:
    assert parse_options(given).heartbeat_ms == (interval, timeout)


async def test_an_interval_given_alone_must_stay_under_the_default_timeout() -> None:
    with pytest.raises(LLMParamInvalid, match="HeartbeatTimeout must exceed"):
        parse_options({"kvflow.HeartbeatInterval": "2000"})
