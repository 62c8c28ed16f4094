"""Where a one-block shm pull spends its time, layer by layer, in one process.

    python scripts/small_path_pieces.py

A child serves ``kvflow bench``'s 4 KiB-block cache over shm; this process times 20,000 one-block
pulls at each layer, outermost last: the endpoint's C call alone, the endpoint's ``blocks_now``,
the engine's ``blocks_now`` and the awaited ``pull_kv_blocks``; mean µs, three rounds. Then
variants of the engine's ``blocks_now`` with one piece left out run in alternating blocks (``no
add``: without the counting; ``no tracing``: without the tracing check), medians against the
current code. Only a map of the costs: the variants are not correct. shm only: its
``blocks_now`` always finishes inside the call, where tcp's and ucx's may return a ``Started``
that this script would have to await.
"""

from __future__ import annotations

import inspect
import statistics
import textwrap
import time
from typing import Any, Callable

from _bench_pair import bench_pair

import kvflow._engine as engine_mod
from kvflow._run import run

N = 20000
_VARIANTS = {
    "current": ("", ""),
    "no add": ("    log.append((moved, metrics_now() - t0))\n", ""),
    "no tracing": ("if local is None or metrics.tracing:", "if local is None:"),
}


def _mean_us(f: Callable[[int], Any], n: int = N) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        f(i)
    return (time.perf_counter() - t0) / n * 1e6


def _variant(name: str) -> Callable[..., Any]:
    src = textwrap.dedent(inspect.getsource(engine_mod.TransferEngine.blocks_now))
    old, new = _VARIANTS[name]
    if old not in src:
        raise SystemExit(f"variant {name!r} no longer matches the engine's code")
    ns: dict[str, Any] = {}
    exec(compile(src.replace(old, new), name, "exec"), engine_mod.__dict__, ns)
    return ns["blocks_now"]  # type: ignore[no-any-return]


async def main() -> None:
    async with bench_pair("shm") as (dd, cache, remote, _pid):
        for _ in range(3):  # the first pulls learn the peer's cache
            await dd.pull_kv_blocks(remote, cache, [0], [0])
        eng = dd._engine
        nb = cache.cache_desc.num_blocks
        link = eng._table.links[remote.cluster_id]
        ep, rem = link.endpoint, link.remotes[remote.cache_id]
        local = eng._registry.lookup(cache.cache_id)

        async def awaited() -> float:
            t0 = time.perf_counter()
            for i in range(N):
                await dd.pull_kv_blocks(remote, cache, [i % nb], [(i * 7) % nb])
            return (time.perf_counter() - t0) / N * 1e6

        pair, out = ep._pairs[(rem.cache_id, local.cache_id)][2], ep._out
        for _ in range(3):
            row = {}
            row["C call"] = _mean_us(lambda i: pair.copy1(False, i % nb, (i * 7) % nb, out))
            row["endpoint"] = _mean_us(lambda i: ep.blocks_now(False, local, rem, [i % nb], [(i * 7) % nb]))
            row["engine"] = _mean_us(
                lambda i: eng.blocks_now("pull", remote, cache, [i % nb], [(i * 7) % nb], None, False))
            row["awaited"] = await awaited()
            print("  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        fns = {k: _variant(k) for k in _VARIANTS}
        got: dict[str, list[float]] = {k: [] for k in _VARIANTS}
        for _ in range(15):
            for k, f in fns.items():
                got[k].append(_mean_us(
                    lambda i, f=f: f(eng, "pull", remote, cache, [i % nb], [(i * 7) % nb], None, False), 4000))
        base = statistics.median(got["current"])
        for k, v in got.items():
            print(f"{k:11} {statistics.median(v):.3f} us ({statistics.median(v) - base:+.3f})")


if __name__ == "__main__":
    run(main())
