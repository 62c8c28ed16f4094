"""The ``kvflow`` command: demo, bench, info."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()


def _demo(args: argparse.Namespace) -> int:
    from ._demo import DTYPES, Shape, run_demo
    from ._run import run

    if args.dtype not in DTYPES:
        console.print(f"[red]unknown dtype {args.dtype}; choose from {', '.join(DTYPES)}")
        return 2
    shape = Shape(args.layers, args.block_tokens, args.kv_heads, args.head_dim, args.prompt_tokens, args.dtype)
    mib = shape.request_bytes / (1 << 20)
    console.print(f"kvflow demo: {shape.layers} layers x (K,V), blocks of {shape.block_tokens} tokens x "
                  f"{shape.kv_heads} heads x {shape.head_dim} {shape.dtype}; prompt {shape.prompt_tokens} tokens "
                  f"= {shape.prompt_blocks} blocks = {mib:.0f} MiB per request")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        push = bar.add_task("prefill -> decode: push layer by layer", total=shape.layers)
        pull = bar.add_task("decode <- prefill: pull blocks", total=1)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(push if what == "push" else pull, completed=done)

        res = run(run_demo(shape, args.transport, progress))
    table = Table(title=f"kvflow demo over {res['transport']}")
    for col in ("step", "bytes", "time", "throughput", "latency"):
        table.add_column(col)
    table.add_row("push (layer by layer)", f"{mib:.0f} MiB", f"{res['push_seconds'] * 1e3:.1f} ms",
                  f"{res['push_gib_s']:.2f} GiB/s",
                  f"layer p50 {res['layer_push_ms_p50']:.2f} ms, p99 {res['layer_push_ms_p99']:.2f} ms")
    table.add_row("pull (block list)", f"{mib:.0f} MiB", f"{res['pull_seconds'] * 1e3:.1f} ms",
                  f"{res['pull_gib_s']:.2f} GiB/s", "")
    console.print(table)
    console.print(f"[green]OK[/green]: all {res['bytes_checked']:,} bytes checked, no other byte changed")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ._bench import format_rows, main_bench, write_json
    from .transport import available_transports

    avail = available_transports()
    names = args.transport.split(",") if args.transport else [n for n, s in avail.items() if s == "ok"]
    for n in names:
        if avail.get(n) != "ok":
            console.print(f"[red]transport {n} unavailable: {avail.get(n, 'not installed')}")
            return 2
    total = int(args.size_mib) << 20
    console.print(f"kvflow bench: transports {', '.join(names)}; {args.size_mib} MiB per transfer, "
                  f"best of {args.repeat} after a warm-up; baselines measured in the same run between the same two "
                  "processes")
    rows = main_bench(names, total, args.repeat)
    table = Table(title="kvflow vs raw baseline (ratio: higher is better for kvflow)")
    for col in ("transport", "op", "block", "kvflow", "baseline", "baseline figure", "ratio"):
        table.add_column(col)
    for r in format_rows(rows):
        table.add_row(*r)
    console.print(table)
    if args.json:
        write_json(args.json, rows, {"size_bytes": total, "repeat": args.repeat, "python": sys.version.split()[0],
                                     "machine": platform.machine(), "cmd": " ".join(sys.argv)})
        console.print(f"wrote {args.json}")
    if args.plot:
        from ._plot import plot_rows

        plot_rows(rows, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _bench_layerwise(args: argparse.Namespace) -> int:
    from ._bench_layerwise import cli

    return cli(args, console)


def _bench_sync(args: argparse.Namespace) -> int:
    from ._bench_sync import cli

    return cli(args)


def _info(args: argparse.Namespace) -> int:
    from . import __version__
    from .transport import available_transports

    info: dict[str, Any] = {"kvflow": __version__, "python": sys.version.split()[0]}
    try:
        import uvloop

        info["uvloop"] = uvloop.__version__
    except ImportError:
        info["uvloop"] = "not installed (asyncio's default loop is used)"
    info["transports"] = available_transports()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k != "transports":
            console.print(f"{k}: {v}")
    console.print("transports:")
    for name, status in info["transports"].items():
        mark = "[green]ok[/green]" if status == "ok" else f"[yellow]unavailable[/yellow]: {status}"
        console.print(f"  {name}: {mark}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvflow`` console script."""
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log link and transport events")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="prefill and decode processes move a KV cache and check every byte")
    d.add_argument("--layers", type=int, default=32)
    d.add_argument("--block-tokens", type=int, default=16)
    d.add_argument("--kv-heads", type=int, default=8)
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--prompt-tokens", type=int, default=4096)
    d.add_argument("--dtype", default="fp16", help="fp16, bf16 or fp32")
    d.add_argument("--transport", default="shm,ucx,tcp", help="allowed transports, in order of preference")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="throughput and latency beside raw baselines measured in the same run")
    b.add_argument("--transport", default="", help="comma list (default: every available transport)")
    b.add_argument("--size-mib", type=int, default=1024, help="bytes per throughput transfer")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--json", help="also write the rows as JSON to this path")
    b.add_argument("--plot", help="also draw throughput against block size as a PNG")
    b.set_defaults(fn=_bench)
    lw = sub.add_parser("bench-layerwise", help="layer-wise overlapped push vs compute-then-push, exposed time")
    lw.add_argument("--transport", default="", help="comma list (default: shm and tcp where available)")
    lw.add_argument("--layers", type=int, default=32)
    lw.add_argument("--layer-mib", type=float, default=4.0, help="K+V bytes per layer, in MiB")
    lw.add_argument("--compute-ms", default="", help="comma list of per-layer compute times in ms "
                    "(default: 1x and 2x the measured one-layer transfer)")
    lw.add_argument("--repeat", type=int, default=5)
    lw.add_argument("--json", help="also write the rows as JSON to this path")
    lw.set_defaults(fn=_bench_layerwise)
    bs = sub.add_parser("bench-sync", help="4 KiB pull latency through kvflow.sync beside the async API")
    from ._bench_sync import add_arguments

    add_arguments(bs)
    bs.set_defaults(fn=_bench_sync)
    i = sub.add_parser("info", help="version, event loop and every transport with ok or the reason")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
