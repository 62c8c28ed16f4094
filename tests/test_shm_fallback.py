"""When shm cannot reach the peer, the link falls back to tcp and says why (real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, available_transports

pytestmark = pytest.mark.asyncio

PEER = textwrap.dedent("""
    import asyncio, sys, numpy as np, kvflow
    from kvflow import LlmDataDist, CacheDesc, DataType

    async def main():
        async with LlmDataDist(1, options={"llm.ListenIpInfo": "127.0.0.1:0",
                                           "kvflow.Transports": "shm,tcp"}) as dd:
            buf = np.arange(4096, dtype=np.uint8)
            cache = await dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, [4, 1024]), [buf])
            print(dd.listen_address[1], cache.cache_id, flush=True)
            await asyncio.to_thread(sys.stdin.read)   # until the test closes stdin

    kvflow.run(main())
""")


@contextlib.asynccontextmanager
async def _peer(*argv: str) -> AsyncIterator[tuple[int, int]]:
    """The PEER script run as ``argv + [python, -c, PEER]``; yields its (port, cache id)."""
    peer = await asyncio.create_subprocess_exec(*argv, sys.executable, "-c", PEER, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert peer.stdout is not None
        line = await asyncio.wait_for(peer.stdout.readline(), 60)
        port, cache_id = (int(x) for x in line.split())
        yield port, cache_id
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        try:
            await asyncio.wait_for(peer.wait(), 10)
        except TimeoutError:
            peer.kill()
            await peer.wait()


def _unshare_usable() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10)
    return None if r.returncode == 0 else f"cannot make a PID namespace here: {r.stderr.decode().strip()}"


@pytest.mark.skipif(available_transports().get("shm") != "ok", reason=f"shm: {available_transports().get('shm')}")
async def test_peer_in_another_pid_namespace_falls_back_to_tcp() -> None:
    why = _unshare_usable()
    if why:
        pytest.skip(why)
    async with _peer("unshare", "--pid", "--fork", "--mount-proc") as (port, cache_id):
        async with LlmDataDist(2, options={"kvflow.Transports": "shm,tcp"}) as dd:
            assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", port)])], 5000) == [0]
            info = dd.link_info(1)
            assert info.transport == "tcp"
            assert "PID namespace" in info.fallbacks["shm"], info.fallbacks
            out = np.zeros(4096, dtype=np.uint8)
            cache = await dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, [4, 1024]), [out])
            await dd.pull_kv_blocks(CacheIndex(1, cache_id), cache, [0, 1, 2, 3], [3, 2, 1, 0])
            want = np.arange(4096, dtype=np.uint8).reshape(4, 1024)[::-1].ravel()
            assert np.array_equal(out, want)


@pytest.mark.skipif(available_transports().get("shm") != "ok", reason=f"shm: {available_transports().get('shm')}")
async def test_shm_unavailable_here_falls_back_to_tcp_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """shm that cannot run in this process (Yama, seccomp; stood in for by its off switch, since
    this machine has neither) is skipped at initialize, and each link names the reason."""
    async with _peer() as (port, _):
        monkeypatch.setenv("KVFLOW_SHM_DISABLE", "1")
        async with LlmDataDist(2, options={"kvflow.Transports": "shm,tcp"}) as dd:
            assert dd.transports == ("tcp",)
            assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", port)])], 5000) == [0]
            info = dd.link_info(1)
            assert info.transport == "tcp"
            assert "KVFLOW_SHM_DISABLE" in info.fallbacks["shm"], info.fallbacks
