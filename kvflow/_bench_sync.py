"""``kvflow bench-sync`` / ``python -m kvflow._bench_sync``: what ``kvflow.sync`` adds to a small pull.

A peer process serves a cache of 4 KiB blocks (the ``kvflow bench`` server). This process pulls one
block at a time, ``n`` times, through :class:`kvflow.LlmDataDist` awaited on an event loop (async)
and through :class:`kvflow.sync.LlmDataDist` called from a plain thread (sync), in alternating rounds
so that both see the same state of the machine, and reports the p50 and p99 of each and the
difference of the p50s: the facade's overhead. Over shm the sync pulls take the caller-thread fast
path. Beside them, the path of every other call: the same blocking call path with a coroutine that
does nothing (no-op), and a bare round trip to the facade's loop thread with no kvflow code
(``call_soon_threadsafe`` of a lock's release): the two thread hand-offs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from typing import Any

import numpy as np

from ._bench import LAT_BLOCK, _caches, _serve
from ._datadist import LlmDataDist
from ._proc import PeerProcess
from ._types import CacheIndex, ClusterInfo, IpInfo, LlmRole

_TOTAL = 4 << 20  # the bench server's cache size: the smallest that holds each of its layouts
_WARMUP = 200


def _lat_desc() -> Any:
    return dict(_caches(_TOTAL))["lat"]


def _pcts(samples: list[float]) -> dict[str, float]:
    arr = np.array(samples) * 1e6
    return {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99))}


def _sync_round(dd: Any, ci: CacheIndex, cache: Any, start: int, count: int, out: list[float]) -> None:
    nblocks = _lat_desc().num_blocks
    for i in range(start, start + count):
        t0 = time.perf_counter()
        dd.pull_kv_blocks(ci, cache, [i % nblocks], [(i * 7) % nblocks])
        out.append(time.perf_counter() - t0)


async def _nothing() -> None:
    return None


def _noop_round(dd: Any, count: int, out: list[float]) -> None:
    for _ in range(count):
        t0 = time.perf_counter()
        dd._call("noop", _nothing)
        out.append(time.perf_counter() - t0)


def _bare_round(loop: asyncio.AbstractEventLoop, count: int, out: list[float]) -> None:
    for _ in range(count):
        lock = threading.Lock()
        lock.acquire()
        t0 = time.perf_counter()
        loop.call_soon_threadsafe(lock.release)
        lock.acquire()
        out.append(time.perf_counter() - t0)


async def _async_round(dd: LlmDataDist, ci: CacheIndex, cache: Any, start: int, count: int,
                       out: list[float]) -> None:
    nblocks = _lat_desc().num_blocks
    for i in range(start, start + count):
        t0 = time.perf_counter()
        await dd.pull_kv_blocks(ci, cache, [i % nblocks], [(i * 7) % nblocks])
        out.append(time.perf_counter() - t0)


async def run_bench_sync(transport: str = "shm", n: int = 2000, rounds: int = 10) -> dict[str, Any]:
    """Pull ``n`` 4 KiB blocks each way over ``transport``; returns the figures."""
    from . import sync

    peer = PeerProcess(_serve)
    loop = asyncio.get_running_loop()
    desc = _lat_desc()
    try:
        peer.send({"total": _TOTAL, "transports": [transport]})
        info = await peer.recv(60)
        await peer.recv(60)  # the raw-baseline details, unused here
        remote = CacheIndex(1, info["caches"]["lat"])
        target = [ClusterInfo(1, [IpInfo(*info["address"])])]
        opts = {"kvflow.Transports": transport}
        abuf, sbuf = np.zeros(desc.tensor_bytes, np.uint8), np.zeros(desc.tensor_bytes, np.uint8)

        add = LlmDataDist(2, LlmRole.DECODER)
        await add.initialize(opts)
        # the sync facade is driven from a plain thread (as in an inference engine's worker), never this loop
        sdd = await loop.run_in_executor(None, lambda: sync.LlmDataDist(3, LlmRole.DECODER, options=opts))
        try:
            await loop.run_in_executor(None, sdd.initialize)
            acache = await add.register_kv_cache(desc, [abuf])
            scache = await loop.run_in_executor(None, sdd.register_kv_cache, desc, [sbuf])
            for code in (await add.link_llm_clusters(target, 5000),
                         await loop.run_in_executor(None, sdd.link_llm_clusters, target, 5000)):
                if code[0] != 0:
                    raise RuntimeError(f"bench link over {transport} failed: {code[0].name}")
            warm: list[float] = []
            await _async_round(add, remote, acache, 0, _WARMUP, warm)
            await loop.run_in_executor(None, _sync_round, sdd, remote, scache, 0, _WARMUP, warm)
            alat: list[float] = []
            slat: list[float] = []
            nlat: list[float] = []
            blat: list[float] = []
            per = max(1, n // rounds)
            for r in range(rounds):
                count = per if r < rounds - 1 else n - per * (rounds - 1)
                await _async_round(add, remote, acache, r * per, count, alat)
                await loop.run_in_executor(None, _sync_round, sdd, remote, scache, r * per, count, slat)
                await loop.run_in_executor(None, _noop_round, sdd, count, nlat)
                await loop.run_in_executor(None, _bare_round, sdd._loop, count, blat)
            ok = bool(np.array_equal(abuf, sbuf))  # the same pulls landed the same bytes both ways
        finally:
            await loop.run_in_executor(None, sdd.close)
            await add.finalize()
    finally:
        await loop.run_in_executor(None, peer.stop)
    a, s = _pcts(alat), _pcts(slat)
    return {"transport": transport, "n": n, "block": LAT_BLOCK, "async": a, "sync": s, "noop": _pcts(nlat),
            "bare": _pcts(blat),
            "overhead_p50_us": s["p50_us"] - a["p50_us"], "same_bytes": ok}


def format_result(res: dict[str, Any]) -> str:
    a, s, z, b = res["async"], res["sync"], res["noop"], res["bare"]
    return (f"{res['transport']}: {res['n']} pulls of {res['block'] >> 10} KiB each way\n"
            f"  async pull (await kvflow.LlmDataDist)  p50 {a['p50_us']:7.2f} us   p99 {a['p99_us']:7.2f} us\n"
            f"  sync pull  (kvflow.sync.LlmDataDist)   p50 {s['p50_us']:7.2f} us   p99 {s['p99_us']:7.2f} us\n"
            f"  sync call of a no-op coroutine         p50 {z['p50_us']:7.2f} us   p99 {z['p99_us']:7.2f} us\n"
            f"  bare round trip to the loop thread     p50 {b['p50_us']:7.2f} us   p99 {b['p99_us']:7.2f} us\n"
            f"  overhead of the sync facade at p50 (sync - async): {res['overhead_p50_us']:+.2f} us")


def cli(args: argparse.Namespace) -> int:
    """``kvflow bench-sync`` and ``python -m kvflow._bench_sync``: print (and write) the figures."""
    from ._run import run

    res = run(run_bench_sync(args.transport, args.n, args.rounds))
    print(format_result(res))
    if not res["same_bytes"]:
        print("FAILED: the two caches differ after the same pulls", file=sys.stderr)
        return 1
    if args.json:
        meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cmd": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **res}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvflow bench-sync``."""
    p.add_argument("--transport", default="shm", help="transport of both links")
    p.add_argument("--n", type=int, default=2000, help="pulls each way")
    p.add_argument("--rounds", type=int, default=10, help="alternating async/sync rounds the pulls are split into")
    p.add_argument("--json", help="also write the figures as JSON to this path")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvflow._bench_sync [--transport shm] [--n 2000] [--rounds 10] [--json PATH]``."""
    parser = argparse.ArgumentParser(prog="python -m kvflow._bench_sync", description=__doc__)
    add_arguments(parser)
    return cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
