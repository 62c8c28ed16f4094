"""The hostile-peer suite: each attack of docs/security.md, run against a real listener.

An attack that once worked stays here as a regression test. Peers are raw sockets speaking the
control protocol by hand (``RawClient``), relays that alter frames in flight, or real peer
processes stopped with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import (
    DataType,
    LlmDataDist,
    LLMKvCacheNotExist,
    LLMParamInvalid,
    LlmRole,
    LLMStatusCode,
    LLMWaitProcessTimeout,
    available_transports,
)
from kvflow import _wire as wire
from kvflow.testing import inspect

from ._relpeer import Peer, RawClient
from .test_reliability import PEER, cleanup, desc, link, make_dd, server, serves_a_real_client, until

__all__ = ["cleanup"]  # the fixture, re-used

KEY = {"kvflow.AuthKey": "a-shared-secret-of-32-bytes-here"}


def _needs(name: str) -> Any:
    why = available_transports().get(name, "not installed")
    return pytest.mark.skipif(why != "ok", reason=f"{name}: {why}")


#: The listener's transports in the handshake attacks: the control plane is the same, but what a
#: welcome discloses and what a choice makes the listener do is each transport's own.
LISTENER = [pytest.param("tcp", id="tcp"), pytest.param("shm,tcp", id="shm", marks=_needs("shm")),
            pytest.param("ucx,tcp", id="ucx", marks=_needs("ucx"))]


# ---------------------------------------------------------------------------------------- handshake
@pytest.mark.asyncio
@_needs("shm")
async def test_shm_choice_never_probes_an_address_the_peer_chose(cleanup: list[Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The old oracle: a keyless client named our pid and the address of a secret in its shm
    description, and read the probe's outcome back from the welcome, one guess at a time."""
    import kvflow_shm
    from kvflow_shm import _lowlevel as ll

    touched: list[tuple[Any, ...]] = []
    for fn in ("probe_read", "transfer", "transfer_table", "vm_copy"):
        real = getattr(ll, fn)
        monkeypatch.setattr(ll, fn, lambda *a, _real=real, **k: (touched.append(a), _real(*a, **k))[1])
    secret = ctypes.create_string_buffer(b"S3CRET!!", 8)
    srv, g, cache = await server(cleanup, desc(4, 4096), **{"kvflow.Transports": "shm,tcp"})
    addr = srv.listen_address
    assert addr is not None and g is not None
    ours = kvflow_shm.ShmTransport(inspect.transport(srv, "shm").ctx).describe()

    def attempt(guess: bytes) -> list[dict[str, Any] | None]:
        c = RawClient(addr)
        try:
            got = [c.hello(9, PEER, transports=["shm", "tcp"])]
            c.send_sealed("choose", {"transport": "shm", "info": {
                **ours, "pid": os.getpid(), "probe_addr": ctypes.addressof(secret), "probe_len": 8,
                "nonce": guess}})
            got.append(c.recv_sealed())
            c.send_sealed("connected", {"ok": False, "why": "attacker"})
            got.append(c.recv_sealed())
            return got
        finally:
            c.close()

    right = await asyncio.to_thread(attempt, b"S3CRET!!")
    wrong = await asyncio.to_thread(attempt, b"xxxxxxxx")
    assert [m and m["t"] for m in right] == ["welcome", "accept", "retry"]
    assert right[1:] == wrong[1:]  # the answers do not depend on the guess
    assert b"S3CRET" not in msgpack.packb(right + wrong)
    assert not touched, touched  # nothing read or wrote any process's memory
    assert not inspect.links(srv)
    await serves_a_real_client(srv, cache, g, cleanup)


@pytest.mark.asyncio
async def test_hello_carries_no_transport_description(cleanup: list[Any]) -> None:
    seen: list[dict[str, Any]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(wire.MAGIC_SIZE)
        seen.append(await wire.read_frame(reader))
        writer.close()

    fake = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        dd = await make_dd(8, **{"kvflow.Transports": ",".join(
            n for n, ok in available_transports().items() if ok == "ok")}, **KEY)
        cleanup.append(dd)
        assert await link(dd, PEER, fake.sockets[0].getsockname()[:2]) == LLMStatusCode.LLM_LINK_FAILED
    finally:
        fake.close()
    (hello,) = seen
    assert set(hello) == {"t", "v", "cluster", "expect", "instance", "auth", "cnonce", "transports"}
    assert hello["transports"] and all(isinstance(n, str) for n in hello["transports"])


def test_short_keys_are_refused() -> None:
    async def init(key: str) -> None:
        async with LlmDataDist(1, LlmRole.PROMPT, options={"kvflow.AuthKey": key, "kvflow.Transports": "tcp"}):
            pass

    with pytest.raises(LLMParamInvalid, match="at least 16 bytes"):
        asyncio.run(init("x" * 15))
    asyncio.run(init("x" * 16))


class Relay:
    """A man in the middle between a real client and a real server: it forwards control frames and
    lets ``alter`` rewrite any one of them (by its decoded map) on the way."""

    def __init__(self, target: tuple[str, int], alter: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        self.target = target
        self.alter = alter
        self.frames: list[tuple[str, bytes]] = []  # (direction, body) as forwarded
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)
        magic = await cr.readexactly(wire.MAGIC_SIZE)
        sw.write(magic)
        if magic != wire.MAGIC_CONTROL:  # a data connection: plain pipe
            await asyncio.gather(self._pipe(cr, sw), self._pipe(sr, cw), return_exceptions=True)
            return
        await asyncio.gather(self._frames(cr, sw, "c2s"), self._frames(sr, cw, "s2c"), return_exceptions=True)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while chunk := await r.read(65536):
                w.write(chunk)
        finally:
            w.close()

    async def _frames(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, direction: str) -> None:
        try:
            while True:
                (n,) = struct.unpack("<I", await r.readexactly(4))
                body = await r.readexactly(n)
                msg = msgpack.unpackb(body, raw=False)
                changed = self.alter({**msg, "_dir": direction})
                if changed is not None:
                    changed.pop("_dir", None)
                    body = msgpack.packb(changed, use_bin_type=True)
                self.frames.append((direction, body))
                w.write(struct.pack("<I", len(body)) + body)
        finally:
            w.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _flip_inner(msg: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    inner = msgpack.unpackb(msg["m"], raw=False)
    inner[key] = value
    return {**msg, "m": msgpack.packb(inner, use_bin_type=True)}


TAMPER: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    # the relay rewrites the initiator's transport list (a downgrade would drop the fast ones)
    "hello": lambda m: {**m, "transports": [*m["transports"], "relay"]} if m["t"] == "hello" else None,
    # the relay swaps in a data token of its own, to take the data connection over
    "welcome": lambda m: _flip_inner(m, "token", b"\xaa" * 16) if m["t"] == "welcome" else None,
    # the relay rewrites the initiator's description of the chosen transport
    "choose": lambda m: _flip_inner(m, "info", {"x": 1}) if m["t"] == "choose" else None,
    "ready": lambda m: _flip_inner(m, "extra", 1) if m["t"] == "ready" else None,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("transports", LISTENER)
@pytest.mark.parametrize("frame", sorted(TAMPER))
async def test_relay_that_alters_the_handshake_is_detected(cleanup: list[Any], frame: str, transports: str) -> None:
    srv, g, cache = await server(cleanup, desc(4, 4096), **KEY, **{"kvflow.Transports": transports})
    assert srv.listen_address is not None and g is not None
    relay = Relay(srv.listen_address, TAMPER[frame])
    via = await relay.start()
    try:
        dd = await make_dd(8, **KEY, **{"kvflow.Transports": transports})
        cleanup.append(dd)
        assert await link(dd, PEER, via) == LLMStatusCode.LLM_LINK_FAILED
        await until(lambda: 8 not in inspect.links(srv) or not inspect.link(srv, 8).healthy, 5, "no server link")
        assert 8 not in inspect.links(dd)
        # the same relay, altering nothing, links: the failure above was the alteration's
        relay.alter = lambda m: None
        dd2 = await make_dd(9, **KEY, **{"kvflow.Transports": transports})
        cleanup.append(dd2)
        assert await link(dd2, PEER, via) == LLMStatusCode.LLM_SUCCESS
        assert dd2.link_info(PEER).transport == transports.split(",")[0]
    finally:
        relay.close()
    await serves_a_real_client(srv, cache, g, cleanup, **KEY)


@pytest.mark.asyncio
async def test_replayed_handshake_is_refused(cleanup: list[Any]) -> None:
    srv, g, _ = await server(cleanup, desc(4, 4096), **KEY)
    assert srv.listen_address is not None and g is not None
    relay = Relay(srv.listen_address, lambda m: None)
    via = await relay.start()
    try:
        dd = await make_dd(8, **KEY)
        cleanup.append(dd)
        assert await link(dd, PEER, via) == LLMStatusCode.LLM_SUCCESS
    finally:
        relay.close()
    sent = [body for d, body in relay.frames if d == "c2s"]

    def replay() -> list[dict[str, Any] | None]:
        c = RawClient(srv.listen_address)  # type: ignore[arg-type]
        try:
            c.send(wire.MAGIC_CONTROL)
            answers = []
            for body in sent[:2]:  # the recorded hello, then the recorded auth
                c.send(struct.pack("<I", len(body)) + body)
                answers.append(c.recv_msg())
            answers.append(c.recv_msg())
            return answers
        finally:
            c.close()

    challenge, answer, after = await asyncio.to_thread(replay)
    assert challenge is not None and challenge["t"] == "challenge"
    assert answer is not None and answer["t"] == "reject" and answer["code"] == LLMStatusCode.LLM_LINK_FAILED
    assert after is None
    assert 8 in inspect.links(srv) and inspect.links(srv)[8].healthy  # the real link is untouched


# hostile handshake inputs: each example is one connection
_frames = st.one_of(
    st.builds(lambda t, m, mac: {"t": t, "m": m, **({"mac": mac} if mac is not None else {})},
              st.sampled_from(["welcome", "choose", "connected", "accept", "retry", "ready", "auth"]),
              st.binary(max_size=64), st.one_of(st.none(), st.binary(max_size=40))),
    st.builds(lambda t, inner: {"t": t, "m": msgpack.packb(inner)},
              st.sampled_from(["choose", "connected"]),
              st.dictionaries(st.sampled_from(["transport", "info", "ok", "why"]),
                              st.one_of(st.text(max_size=8), st.integers(-(1 << 63), (1 << 64) - 1), st.none(),
                                        st.booleans(),
                                        st.dictionaries(st.text(max_size=4), st.integers(0, 1 << 32), max_size=3)),
                              max_size=4)),
    st.builds(lambda n: {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": 9, "expect": PEER,
                         "instance": "x", "auth": False, "cnonce": b"", "transports": ["tcp"] * n},
              st.integers(0, 40)),
    st.just({"t": "auth", "mac": b"\0" * 32}),
    st.just({"t": "hello", "transports": "x" * 100_000}),
)
FUZZ_EXAMPLES = int(os.environ.get("KVFLOW_HANDSHAKE_FUZZ", "30"))
fuzz_log: dict[str, int] = {"inputs": 0, "links": 0}


@pytest.mark.asyncio
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transports", LISTENER)
@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
async def test_handshake_fuzz_never_links_crashes_or_hangs(cleanup: list[Any], keyed: bool, transports: str) -> None:
    """Truncated, reordered, replayed and oversized frames, wrong MACs: the server closes each
    connection within the handshake bound, links nobody, and still serves a real client."""
    opts = {**(KEY if keyed else {}), "kvflow.HeartbeatInterval": "100", "kvflow.HeartbeatTimeout": "600",
            "kvflow.Transports": transports}
    srv, g, cache = await server(cleanup, desc(4, 4096), **opts)
    addr = srv.listen_address
    assert addr is not None and g is not None
    worst = [0.0]

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(with_hello=st.booleans(), frames=st.lists(_frames, max_size=5), cut=st.integers(0, 12))
    def one(with_hello: bool, frames: list[dict[str, Any]], cut: int) -> None:
        c = RawClient(addr, timeout=3)
        try:
            t0 = time.monotonic()
            c.send(wire.MAGIC_CONTROL)
            if with_hello:
                c.send_msg({"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": 9, "expect": PEER,
                            "instance": "fuzz", "auth": keyed, "cnonce": os.urandom(32),
                            "transports": transports.split(",")})
            try:
                for i, f in enumerate(frames):
                    body = msgpack.packb(f, use_bin_type=True)
                    raw = struct.pack("<I", len(body)) + body
                    c.send(raw[:cut] if i == len(frames) - 1 and cut else raw)  # the last one maybe truncated
            except (BrokenPipeError, ConnectionResetError):
                pass  # already closed on us
            else:
                assert c.closed_within(3.0)
            worst[0] = max(worst[0], time.monotonic() - t0)
            fuzz_log["inputs"] += 1
        finally:
            c.close()

    await asyncio.to_thread(one)
    assert worst[0] < 2.5, worst  # the handshake bound (1 s here), with slack for a loaded machine
    assert not inspect.links(srv) and not inspect.linking(srv) and not inspect.data_waiters(srv)
    await serves_a_real_client(srv, cache, g, cleanup, **(KEY if keyed else {}), **{"kvflow.Transports": transports})


# ---------------------------------------------------------------------------------------- unregister
UNREG_VARIANTS = {
    "tcp": {"kvflow.Transports": "tcp"},
    "shm": {"kvflow.Transports": "shm"},
    "ucx": {"kvflow.Transports": "ucx", "kvflow.ucx.TLS": "self,sm,cma"},
}


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", sorted(UNREG_VARIANTS))
async def test_unregister_never_succeeds_while_a_stopped_peer_can_still_write(cleanup: list[Any],
                                                                              variant: str) -> None:
    """A peer pushing into our cache is SIGSTOPped mid-push. Unregister must not report success
    while it could still land bytes; tcp (we write our memory ourselves) may, and nothing lands."""
    opts = UNREG_VARIANTS[variant]
    name = opts["kvflow.Transports"]
    if available_transports().get(name) != "ok":
        pytest.skip(f"{name}: {available_transports().get(name)}")
    big = desc(64, 1 << 20, tensors=2)  # 128 MiB
    srv, g, cache = await server(cleanup, big, seed=None, **opts)
    assert srv.listen_address is not None and g is not None
    peer = Peer(8, caches=[(2, int(DataType.DT_UINT8), list(big.shape), 77)], options=opts)
    cleanup.append(peer)
    cleanup.append(peer.pid)
    assert await peer.call("link", PEER, *srv.listen_address, 5000) == 0
    blocks = list(range(64))
    push = asyncio.ensure_future(peer.call("push_blocks", PEER, cache.cache_id, peer.caches[0], blocks, blocks,
                                           20000, timeout=60))
    await until(lambda: any(bool(t.any()) for t in g.tensors), 10, "the push to start landing")
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        if name == "tcp":
            await srv.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)
            for t in g.tensors:
                t[:] = 0x5A  # the caller reuses the memory at once
            os.kill(peer.pid, signal.SIGCONT)
            await asyncio.wait([push], timeout=10)
            await asyncio.sleep(0.3)
            assert all((t == 0x5A).all() for t in g.tensors), "a byte landed after unregister returned"
            return
        with pytest.raises(LLMWaitProcessTimeout, match="cluster 8"):
            await srv.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)
        assert srv.link_info(8).state == "broken"
        assert inspect.local_cache(srv, cache.cache_id) is not None  # still registered: the memory is not free
        with pytest.raises(LLMWaitProcessTimeout):  # and stays so while that process lives
            await srv.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    if name == "shm":  # a peer known dead no longer holds the memory
        peer.kill()
        await asyncio.wait([push], timeout=10)
        ep = inspect.link(srv, 8).endpoint
        assert ep is not None
        await until(ep.peer_exited, 10, "the peer's exit to be seen")
        await srv.unregister_kv_cache(cache.cache_id, timeout_in_millis=300)


@pytest.mark.asyncio
@pytest.mark.parametrize("variant", sorted(UNREG_VARIANTS))
async def test_unregister_with_a_live_peer_is_confirmed_and_final(cleanup: list[Any], variant: str) -> None:
    """The ordinary case stays quick: a linked, answering peer confirms, and its later lookups fail."""
    opts = UNREG_VARIANTS[variant]
    name = opts["kvflow.Transports"]
    if available_transports().get(name) != "ok":
        pytest.skip(f"{name}: {available_transports().get(name)}")
    d = desc(4, 4096)
    srv, g, cache = await server(cleanup, d, **opts)
    assert srv.listen_address is not None and g is not None
    peer = Peer(8, caches=[(2, int(DataType.DT_UINT8), list(d.shape), None)], options=opts)
    cleanup.append(peer)
    assert await peer.call("link", PEER, *srv.listen_address, 5000) == 0
    await peer.call("pull_blocks", PEER, cache.cache_id, peer.caches[0], [0, 1], [0, 1], 5000)
    await srv.unregister_kv_cache(cache.cache_id, timeout_in_millis=2000)
    assert srv.link_info(8).state == "linked"
    with pytest.raises(LLMKvCacheNotExist):
        await peer.call("pull_blocks", PEER, cache.cache_id, peer.caches[0], [0], [0], 2000)


@pytest.mark.asyncio
@pytest.mark.parametrize("runs", [1, 16])  # the reply's payload as views; as a run table (more than 8 runs)
async def test_a_reply_revoked_before_its_first_byte_reads_nothing_of_the_unregistered_cache(runs: int) -> None:
    """The peer reads 128 KiB of a cache; our send side is full, so the reply's first sendmsg gets
    EAGAIN and leaves a cursor over the reply. The cache's unregistration then passes its deadline
    (``revoke``): the reply becomes an error header, and when the socket drains the peer gets that
    header and nothing of the cache, which the application has meanwhile refilled with 0xEE. The
    stale cursor sent the original reply from the unregistered memory (1 run) or a header promising
    a payload that never came (16 runs)."""
    import socket

    import numpy as np

    from kvflow import LLMKvCacheNotExist, LLMStatusCode
    from kvflow._memory import Registry
    from kvflow._tcp import HDR, READ_REQ, READ_RSP, TcpChannel
    from kvflow._types import CacheDesc, DataType

    reg = Registry()
    arr = np.full(1 << 20, 0x11, dtype=np.uint8)
    local = reg.add(CacheDesc(1, DataType.DT_INT8, [1 << 20]), [arr])
    lsock = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(lsock.getsockname())
    ours, _ = lsock.accept()
    lsock.close()
    ch = TcpChannel(ours, reg, lambda exc: None, 0.0, workers=None)
    try:
        async with asyncio.timeout(30):
            filler = 0
            for _ in range(20):  # fill our send side: the peer reads nothing yet
                while True:
                    try:
                        filler += ours.send(b"\0" * 65536)
                    except BlockingIOError:
                        break
                await asyncio.sleep(0.01)
            nbytes, base = 128 << 10, int(arr.ctypes.data)
            step = nbytes // runs
            pairs = [v for i in range(runs) for v in (base + i * step, step)]
            request = HDR.pack(READ_REQ, 0, 0, runs, 7, local.cache_id, nbytes) + struct.pack(f"<{2 * runs}Q", *pairs)
            peer.sendall(request)
            await until(lambda: bool(ch._sendq) and ch._sendq[0].cursor is not None, 5)
            assert ch._sendq[0].idx == -1  # no byte of the reply has gone out
            ch.revoke(local, LLMKvCacheNotExist("cache gone"))
            assert local.inflight == 0
            arr[:] = 0xEE  # the application reuses the memory once unregister returned
            peer.setblocking(False)
            got = bytearray()
            want = filler + HDR.size
            deadline = time.monotonic() + 10
            grace = None  # once the header is in: 0.3 s more for any byte that follows it
            while time.monotonic() < (deadline if grace is None else grace):
                try:
                    got += peer.recv(1 << 20)
                except BlockingIOError:
                    await asyncio.sleep(0.005)
                if grace is None and len(got) >= want:
                    grace = time.monotonic() + 0.3
            assert len(got) == want  # nothing follows the error header
            kind, _flags, _res, _count, req_id, status, total = HDR.unpack(bytes(got[filler:]))
            assert (kind, req_id, status, total) == (READ_RSP, 7, int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST), 0)
    finally:
        ch.close()
        peer.close()
