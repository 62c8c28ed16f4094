"""``kvflow bench-layerwise``: layer-wise overlapped push against compute-then-push, in one run.

A prefill (this process) "computes" its layers one after another (a sleep: an accelerator's time
costs the host no CPU) and a decode process receives the KV cache. For each transport and each
per-layer compute time it measures, between the same two processes:

- one layer's transfer alone (``push_kv_blocks`` of one layer, median);
- compute-then-push: all layers computed, then the whole cache pushed in one call;
- layer-wise: ``transfer_cache_async`` with a ``LayerEvents`` that the compute marks;
- the transfer time left exposed after the last layer is ready (layer-wise): from the compute
  marking the last layer to the last byte acknowledged by the decode side.

Each is measured twice: with the compute on a thread of its own (``where="thread"``, the pattern of
docs/layerwise.md) and awaited on the caller's event loop, the one kvflow runs on (``where="loop"``:
each layer an ``asyncio.sleep``, as a serving loop that awaits its launches). A thread row is ok when
the exposed median is at most 1.5 x one layer alone + 2 ms; a loop row when the layer-wise total is at
most the compute alone (measured on the loop in the same run) + 1.1 x one layer + 1 ms: the loop is
not held long enough to delay the compute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from ._datadist import LlmDataDist
from ._layerwise import LayerEvents, TransferConfig
from ._proc import PeerProcess, recv_from_parent
from ._types import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmRole

BLOCK_BYTES = 32 << 10  # 16 tokens x 8 KV heads x 128 x fp16: one block of one tensor
PREFILL, DECODE = 1, 2


@dataclass
class Row:
    """One line of the table (times in ms)."""

    transport: str
    layers: int
    layer_mib: float
    compute_ms: float
    layer_transfer_ms: float
    compute_total_ms: float
    serial_ms: float
    layerwise_ms: float
    exposed_ms: float
    exposed_max_ms: float
    target_ms: float
    where: str = "thread"  # where the compute runs: "thread", or "loop" (awaited on the caller's loop)

    @property
    def ok(self) -> bool:
        """The target holds (it is stated for per-layer compute >= one layer's transfer)."""
        return (self.layerwise_ms if self.where == "loop" else self.exposed_ms) <= self.target_ms

    @property
    def saved(self) -> float:
        return 1 - self.layerwise_ms / self.serial_ms if self.serial_ms else 0.0


def _desc(layers: int, blocks: int) -> CacheDesc:
    return CacheDesc(2 * layers, DataType.DT_UINT8, [blocks, BLOCK_BYTES])


async def _decode(conn: Connection) -> None:
    args = conn.recv()
    desc = _desc(args["layers"], args["blocks"])
    servers = []
    for t in args["transports"]:
        dd = LlmDataDist(DECODE, LlmRole.DECODER)
        await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "kvflow.Transports": t})
        tensors = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(desc.num_tensors)]
        cache = await dd.register_kv_cache(desc, tensors)
        servers.append(dd)
        conn.send({"transport": t, "address": dd.listen_address, "cache_id": cache.cache_id})
    await recv_from_parent(conn)
    for dd in servers:
        await dd.finalize()


def _compute(events: LayerEvents | None, layers: int, seconds: float) -> asyncio.Future[None]:
    """The prefill's compute: one layer every ``seconds`` (a sleep) on a thread, each marked ready as
    it finishes; the future resolves once the last layer is done."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def run() -> None:
        for layer in range(layers):
            time.sleep(seconds)
            if events is not None:
                events.mark_ready(layer)
        loop.call_soon_threadsafe(done.set_result, None)

    threading.Thread(target=run, name="prefill-compute", daemon=True).start()
    return done


async def _compute_on_loop(events: LayerEvents | None, layers: int, seconds: float) -> None:
    """The prefill's compute awaited on the caller's loop: one ``asyncio.sleep`` per layer."""
    for layer in range(layers):
        await asyncio.sleep(seconds)
        if events is not None:
            events.mark_ready(layer)


def _start_compute(where: str, events: LayerEvents | None, layers: int, seconds: float) -> asyncio.Future[None]:
    """Start the compute on a thread of its own or as a task on this loop; await the result for its end."""
    if where == "thread":
        return _compute(events, layers, seconds)
    return asyncio.ensure_future(_compute_on_loop(events, layers, seconds))


async def _one_transport(transport: str, info: dict[str, Any], layers: int, blocks: int, compute_ms: list[float] | None,
                         repeat: int, progress: Callable[[Row], None] | None) -> list[Row]:
    desc = _desc(layers, blocks)
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, desc.tensor_bytes, dtype=np.uint8) for _ in range(desc.num_tensors)]
    src_blocks = list(range(blocks))
    dst_blocks = rng.permutation(blocks).tolist()  # the decode side's block table is scattered
    rows: list[Row] = []
    async with LlmDataDist(PREFILL, LlmRole.PROMPT,
                           options={"kvflow.Transports": transport, "llm.SyncKvCacheWaitTime": "60000"}) as dd:
        cache = await dd.register_kv_cache(desc, src)
        ret = await dd.link_llm_clusters([ClusterInfo(DECODE, [IpInfo(*info["address"])])], 5000)
        if ret[0] != 0:
            raise RuntimeError(f"bench link over {transport} failed: {ret[0].name}")
        dst = CacheIndex(DECODE, info["cache_id"])
        # one layer's transfer alone
        alone = []
        for i in range(max(20, 2 * layers)):
            layer = i % layers
            t0 = time.perf_counter()
            await dd.push_kv_blocks(cache, dst, src_blocks, dst_blocks, KvCacheExtParam((layer, layer), (layer, layer)))
            alone.append(time.perf_counter() - t0)
        t_layer = float(np.median(alone[2:]))
        computes = compute_ms or [round(t_layer * 1000 * f + 0.05, 1) for f in (1.0, 2.0)]
        for where in ("thread", "loop"):
            for c_ms in computes:
                c = c_ms / 1000
                alone_c, serial, overlapped, exposed, computed = [], [], [], [], []
                for _ in range(repeat):
                    if where == "loop":  # the loop rows' baseline: the compute alone on this loop
                        t0 = time.perf_counter()
                        await _start_compute(where, None, layers, c)
                        alone_c.append(time.perf_counter() - t0)

                    t0 = time.perf_counter()
                    await _start_compute(where, None, layers, c)
                    await dd.push_kv_blocks(cache, dst, src_blocks, dst_blocks)
                    serial.append(time.perf_counter() - t0)

                    events = LayerEvents(layers)
                    t0 = time.perf_counter()
                    task = dd.transfer_cache_async(cache, events, [TransferConfig(dst)], src_blocks, dst_blocks)
                    done = _start_compute(where, events, layers, c)
                    await task
                    await done
                    overlapped.append(time.perf_counter() - t0)
                    last_ready = events.ready_at[layers - 1]
                    assert last_ready is not None
                    exposed.append(max(task.layer_sent_at.values()) - last_ready)
                    computed.append(last_ready - t0)
                    await asyncio.sleep(0.01)
                base = alone_c if where == "loop" else computed
                m0, m1, m2, m3 = (float(np.median(v)) * 1e3 for v in (base, serial, overlapped, exposed))
                target = m0 + 1.1 * t_layer * 1e3 + 1.0 if where == "loop" else (1.5 * t_layer + 0.002) * 1e3
                row = Row(transport, layers, 2 * desc.tensor_bytes / (1 << 20), c_ms, t_layer * 1e3, m0, m1, m2, m3,
                          float(np.max(exposed)) * 1e3, target, where)
                rows.append(row)
                if progress:
                    progress(row)
    return rows


async def run_layerwise_bench(transports: list[str], layers: int = 32, layer_mib: float = 4.0,
                              compute_ms: list[float] | None = None, repeat: int = 5,
                              progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Measure every transport; returns the rows of the table. ``compute_ms`` defaults to one and two
    times the measured one-layer transfer time."""
    blocks = max(1, int(layer_mib * (1 << 20) / 2 / BLOCK_BYTES))
    peer = PeerProcess(_decode)
    rows: list[Row] = []
    try:
        peer.send({"layers": layers, "blocks": blocks, "transports": transports})
        infos = [await peer.recv(60) for _ in transports]
        for info in infos:
            rows += await _one_transport(info["transport"], info, layers, blocks, compute_ms, repeat, progress)
    finally:
        peer.stop()
    return rows


def cli(args: argparse.Namespace, console: Any) -> int:
    """The ``kvflow bench-layerwise`` command."""
    from rich.table import Table

    from ._discovery import available_transports
    from ._run import run

    avail = available_transports()
    names = args.transport.split(",") if args.transport else [n for n in ("shm", "tcp") if avail.get(n) == "ok"]
    for n in names:
        if avail.get(n) != "ok":
            console.print(f"[red]transport {n} unavailable: {avail.get(n, 'not installed')}")
            return 2
    computes = [float(x) for x in args.compute_ms.split(",")] if args.compute_ms else None
    if not 1 <= args.layers <= 512:
        console.print("[red]--layers must be within 1..512")
        return 2
    console.print(f"kvflow bench-layerwise: {args.layers} layers x {args.layer_mib:g} MiB (K+V, scattered 32 KiB "
                  f"blocks), transports {', '.join(names)}; median of {args.repeat}; compute = a sleep per layer")
    rows = run(run_layerwise_bench(names, args.layers, args.layer_mib, computes, args.repeat))
    table = Table(title="layer-wise overlapped push vs compute-then-push (times in ms)")
    for col in ("transport", "compute/layer", "compute on", "1 layer alone", "compute only", "compute-then-push",
                "layer-wise", "saved", "exposed p50", "exposed max", "target", "ok"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.transport, f"{r.compute_ms:.2f}", r.where, f"{r.layer_transfer_ms:.2f}",
                      f"{r.compute_total_ms:.1f}", f"{r.serial_ms:.1f}",
                      f"{r.layerwise_ms:.1f}", f"{r.saved:.0%}", f"{r.exposed_ms:.2f}", f"{r.exposed_max_ms:.2f}",
                      f"{r.target_ms:.2f}", "yes" if r.ok else "[red]no")
    console.print(table)
    console.print("exposed: from the compute marking the last layer ready to the last byte acknowledged. target: "
                  "compute on a thread, exposed p50 <= 1.5 x one layer alone + 2 ms; compute on the loop, "
                  "layer-wise <= compute only + 1.1 x one layer alone + 1 ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"layers": args.layers, "layer_mib": args.layer_mib, "repeat": args.repeat,
                                "python": sys.version.split()[0], "machine": platform.machine(),
                                "cmd": " ".join(sys.argv)},
                       "rows": [{**asdict(r), "ok": r.ok} for r in rows]}, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0 if all(r.ok for r in rows if r.compute_ms >= r.layer_transfer_ms) else 1
