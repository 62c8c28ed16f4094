"""A network cut between two network namespaces (issue 6).

The test makes a network namespace and a veth pair (one end in the namespace), runs the peer
inside the namespace with ``ip netns exec``, links to it over the veth, and cuts the cable
with ``ip link set <host end> down``: mid-transfer, and again on an idle link. Each time the
affected calls fail with a typed error and the link is marked broken within the heartbeat
bound; after ``ip link set ... up`` the link is made again and data moves.

Needs root and iproute2 (``apt-get install -y iproute2``); skipped otherwise. Names are unique
per run and everything made here is deleted in a ``finally``.

Run as a script (``python tests/test_netns.py peer <ip>``) this file is the peer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

HB = {"kvflow.HeartbeatInterval": "200", "kvflow.HeartbeatTimeout": "1000"}
PEER, LOCAL = 1, 2
BLOCKS, BLOCK_BYTES, TENSORS = 64, 1 << 20, 2  # 128 MiB: a pull takes a good while over veth
_SELF = os.path.abspath(__file__)


def pattern(seed: int, tensor: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng((seed, tensor)).integers(0, 256, size=nbytes, dtype=np.uint8)


# ------------------------------------------------------------------------------------------ the peer
async def _peer(ip: str) -> None:
    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole

    dd = LlmDataDist(PEER, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": f"{ip}:0", "kvflow.Transports": "tcp", **HB})
    desc = CacheDesc(TENSORS, DataType.DT_UINT8, [BLOCKS, BLOCK_BYTES])
    tensors = [pattern(5, t, desc.tensor_bytes) for t in range(TENSORS)]
    cache = await dd.register_kv_cache(desc, tensors)
    assert dd.listen_address is not None
    print(json.dumps({"port": dd.listen_address[1], "cache_id": cache.cache_id}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()  # "stop" or EOF
    await dd.finalize()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "peer":
    from kvflow import run

    run(_peer(sys.argv[2]))
    sys.exit(0)


# ------------------------------------------------------------------------------------------ the test
import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

from kvflow import (  # noqa: E402
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LLMException,
    LlmRole,
    LLMStatusCode,
)
from kvflow import _tcp as tcp  # noqa: E402
from kvflow.testing import inspect  # noqa: E402


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (apt-get install -y iproute2)"
    name = f"kvfprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
    if r.returncode:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Net:
    """A namespace joined to this one by a veth pair: host end ``host_ip``, namespace end ``ns_ip``."""

    def __init__(self) -> None:
        tag = os.urandom(3).hex()
        self.ns = f"kvflow-{os.getpid()}-{tag}"
        self.host_if, self.ns_if = f"kvh{tag}", f"kvn{tag}"  # interface names: at most 15 characters
        a, b = os.urandom(2)
        self.host_ip, self.ns_ip = f"10.213.{a}.{(b & 0xFC) + 1}", f"10.213.{a}.{(b & 0xFC) + 2}"

    def up(self) -> None:
        ip("netns", "add", self.ns)
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        ip("link", "set", self.ns_if, "netns", self.ns)
        ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, ns=self.ns)
        ip("link", "set", "lo", "up", ns=self.ns)
        ip("link", "set", self.ns_if, "up", ns=self.ns)
        ip("link", "set", self.host_if, "up")

    def cable(self, up: bool) -> None:
        ip("link", "set", self.host_if, "up" if up else "down")

    def down(self) -> None:
        for cmd in (["ip", "link", "del", self.host_if], ["ip", "netns", "del", self.ns]):
            subprocess.run(cmd, capture_output=True, timeout=10)


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
    try:
        n.up()
        yield n
    finally:
        n.down()


@pytest_asyncio.fixture
async def peer(net: Net) -> Any:
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", net.ns, sys.executable, _SELF, "peer", net.ns_ip,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        info = json.loads(line)
        yield proc, (net.ns_ip, info["port"]), info["cache_id"]
    finally:
        if proc.returncode is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(b"stop\n")
                await asyncio.wait_for(proc.wait(), 5)
            except (TimeoutError, OSError, ConnectionError):
                proc.kill()  # our own child, by its handle
                await proc.wait()


async def _relink(dd: LlmDataDist, address: tuple[str, int], within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        ret = (await dd.link_llm_clusters([ClusterInfo(PEER, [IpInfo(*address)])], 1000))[0]
        if ret == LLMStatusCode.LLM_SUCCESS:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"could not link again: {ret.name}")
        await asyncio.sleep(0.1)


async def _broken_within(dd: LlmDataDist, seconds: float) -> float:
    t0 = time.monotonic()
    while dd.link_info(PEER).state != "broken":
        if time.monotonic() - t0 > seconds:
            raise AssertionError(f"link still {dd.link_info(PEER).state} {seconds} s after the cut")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_cable_cut_mid_transfer_then_restored(net: Net, peer: Any) -> None:
    _proc, address, cache_id = peer
    desc = CacheDesc(TENSORS, DataType.DT_UINT8, [BLOCKS, BLOCK_BYTES])
    dd = LlmDataDist(LOCAL, LlmRole.DECODER)
    await dd.initialize({"kvflow.Transports": "tcp", "llm.SyncKvCacheWaitTime": "30000", **HB})
    try:
        await _relink(dd, address, 10)
        dst = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(TENSORS)]
        cache = await dd.register_kv_cache(desc, dst)
        src = CacheIndex(PEER, cache_id)
        blocks = list(range(BLOCKS))

        # 1. cut while a 128 MiB pull is landing
        pull = asyncio.ensure_future(dd.pull_kv_blocks(src, cache, blocks, blocks))
        ended: list[float] = []
        pull.add_done_callback(lambda _f: ended.append(time.monotonic()))
        ep = inspect.links(dd)[PEER].endpoint
        assert isinstance(ep, tcp.TcpEndpoint)
        ch = ep._ch
        t_start = time.monotonic()
        while not (ch._state == tcp._ST_PAYLOAD and ch._left < desc.tensor_bytes * TENSORS - (4 << 20)):
            assert not pull.done() and time.monotonic() - t_start < 20, "the pull never got going"
            await asyncio.sleep(0.0005)
        cut = time.monotonic()
        net.cable(False)
        with pytest.raises(LLMException):
            await asyncio.wait_for(pull, 10)
        assert ended[0] - cut < 1.6, f"the pull failed {ended[0] - cut:.2f} s after the cut (bound 1 s + slack)"
        assert dd.link_info(PEER).state == "broken"
        landed = [t.copy() for t in dst]

        # 2. cable back: link again, data moves, nothing of the old pull landed afterwards
        net.cable(True)
        await _relink(dd, address, 10)
        await dd.pull_kv_blocks(src, cache, [1, 2], [1, 2])
        s = desc.stride
        for t in range(TENSORS):
            ref = pattern(5, t, desc.tensor_bytes)
            assert (dst[t][s:3 * s] == ref[s:3 * s]).all()
            assert (dst[t][3 * s:] == landed[t][3 * s:]).all()

        # 3. cut an idle link: noticed within the heartbeat bound (sooner if the kernel reports the
        # interface going away to a socket that sends a heartbeat meanwhile)
        net.cable(False)
        await _broken_within(dd, 1.6)
        assert isinstance(inspect.links(dd)[PEER].error, LLMException)
        net.cable(True)
        await _relink(dd, address, 10)
        await dd.pull_kv_blocks(src, cache, [7], [0])
        assert (dst[1][:s] == pattern(5, 1, desc.tensor_bytes)[7 * s:8 * s]).all()
    finally:
        await dd.finalize()
