"""The ``kvflow`` command: demo, bench, bench-layerwise, bench-sync, bench-links, info."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.table import Table
from rich.text import Text

console = Console()

#: What ``kvflow --help`` says before the commands (plain text: argparse prints it as it is).
DESCRIPTION = ("Move LLM KV cache between prefill and decode processes (LLM-DataDist's KV cache API, "
               "from asyncio). Start with 'kvflow demo'; 'kvflow info' lists the installed transports; "
               "'kvflow COMMAND --help' shows a command's options and their defaults.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already names its default or
    there is none to show (a flag, an empty string, None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, "", False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)


def shadowing_kvflow(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """Why a script run in ``cwd`` would not import this kvflow, or None if it would.

    ``python script.py`` puts the script's directory first on ``sys.path``. A directory there called
    ``kvflow`` without an ``__init__.py`` (typically a clone of this repository) is then imported as
    an empty namespace package whenever nothing later on ``sys.path`` holds a regular ``kvflow``
    package: an editable install is found by a finder that Python consults only after ``sys.path``.
    No kvflow code runs in that case, so only this command can say it; see docs/quickstart.md."""
    from importlib.machinery import PathFinder

    here = Path(cwd if cwd is not None else os.getcwd())
    ours = Path(__file__).resolve().parent
    spec = PathFinder.find_spec("kvflow", [str(here), *sys.path])
    if spec is None:
        return None  # nothing on sys.path: the installed package's own finder answers, as for us
    if spec.origin is not None and spec.has_location:
        found = Path(spec.origin).resolve().parent
        if found == ours:
            return None
        return (f"a script run in {here} imports kvflow from {found}, not the installed one in {ours}: "
                "rename or move that directory, or run the script elsewhere")
    dirs = [str(d) for d in (spec.submodule_search_locations or [])]
    if any(Path(d).resolve() == ours for d in dirs):
        return None
    return (f"a script run in {here} imports {', '.join(dirs)} as an empty 'kvflow' namespace package "
            f"(a directory without __init__.py, e.g. a clone of the repository) instead of the installed "
            f"kvflow in {ours}, and fails with \"cannot import name ... from 'kvflow' (unknown location)\": "
            "rename the clone (git clone ... kvflow-src) or run the script from another directory")


def _demo_transport_error(spec: str) -> str | None:
    """One line if ``--transport`` names a transport that is not installed or none that can run here."""
    from . import available_transports

    avail = available_transports()
    listing = ", ".join(f"{n} ({'ok' if s == 'ok' else 'unavailable: ' + s})" for n, s in avail.items())
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in avail]
    if not names or unknown:
        what = f"no transport called {unknown[0]!r} is installed" if unknown else "no transport given"
        return f"kvflow demo: {what}; installed transports: {listing}"
    if not any(avail[n] == "ok" for n in names):
        return f"kvflow demo: none of {', '.join(names)} can run here; installed transports: {listing}"
    return None


class _StepTime(ProgressColumn):
    """A step's own time, in the table's unit: from its first request to its last acknowledged byte.

    Live while the step runs; once ``measured[task_id]`` is set, the figure that the table shows."""

    def __init__(self) -> None:
        super().__init__()
        self.measured: dict[Any, float] = {}

    def render(self, task: Task) -> Text:
        elapsed = self.measured.get(task.id, task.finished_time if task.finished else task.elapsed)
        return Text("waiting" if elapsed is None else f"{elapsed * 1e3:.1f} ms", style="progress.elapsed")


def _demo(args: argparse.Namespace) -> int:
    from ._demo import DTYPES, Shape, run_demo
    from ._run import run

    if args.dtype not in DTYPES:
        console.print(f"[red]unknown dtype {args.dtype}; choose from {', '.join(DTYPES)}")
        return 2
    problem = _demo_transport_error(args.transport)
    if problem:
        print(problem, file=sys.stderr)  # one line, not wrapped by rich
        return 2
    shape = Shape(args.layers, args.block_tokens, args.kv_heads, args.head_dim, args.prompt_tokens, args.dtype)
    mib = shape.request_bytes / (1 << 20)
    console.print(f"kvflow demo: {shape.layers} layers x (K,V), blocks of {shape.block_tokens} tokens x "
                  f"{shape.kv_heads} heads x {shape.head_dim} {shape.dtype}; prompt {shape.prompt_tokens} tokens "
                  f"= {shape.prompt_blocks} blocks = {mib:.0f} MiB per request")
    console.print("setting up: starting the prefill process, filling both requests, linking ...")
    step_time = _StepTime()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  step_time, console=console, transient=False) as bar:
        # Each bar's clock starts with its step (start=False until then), so that it shows the same
        # time as the table below: setup is in neither.
        push = bar.add_task("prefill -> decode: push layer by layer", total=shape.layers, start=False)
        pull = bar.add_task("decode <- prefill: pull blocks", total=1, start=False)

        def progress(what: str, done: int, total: int) -> None:
            task = push if what == "push" else pull
            if done == 0:
                bar.start_task(task)
            bar.update(task, completed=done)

        res = run(run_demo(shape, args.transport, progress))
        step_time.measured.update({push: res["push_seconds"], pull: res["pull_seconds"]})
        bar.refresh()
    table = Table(title=f"kvflow demo over {res['transport']}")
    for col in ("step", "bytes", "time", "throughput", "latency"):
        table.add_column(col)
    table.add_row("push (layer by layer)", f"{mib:.0f} MiB", f"{res['push_seconds'] * 1e3:.1f} ms",
                  f"{res['push_gib_s']:.2f} GiB/s",
                  f"layer p50 {res['layer_push_ms_p50']:.2f} ms, p99 {res['layer_push_ms_p99']:.2f} ms")
    table.add_row("pull (block list)", f"{mib:.0f} MiB", f"{res['pull_seconds'] * 1e3:.1f} ms",
                  f"{res['pull_gib_s']:.2f} GiB/s", "")
    console.print(table)
    console.print(f"time: from a step's first request to its last acknowledged byte (bars and table alike); "
                  f"setup before it (processes, memory, link) took {res['setup_seconds']:.1f} s and is in neither")
    console.print(f"[green]OK[/green]: all {res['bytes_checked']:,} bytes checked, no other byte changed")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ._bench import format_rows, main_bench, write_json
    from ._discovery import available_transports
    from ._options import option_pairs
    from ._status import LLMParamInvalid

    avail = available_transports()
    names = args.transport.split(",") if args.transport else [n for n, s in avail.items() if s == "ok"]
    for n in names:
        if avail.get(n) != "ok":
            console.print(f"[red]transport {n} unavailable: {avail.get(n, 'not installed')}")
            return 2
    try:
        options = option_pairs(args.option)
    except ValueError as e:
        console.print(f"[red]kvflow bench: {e}")
        return 2
    total = int(args.size_mib) << 20
    console.print(f"kvflow bench: transports {', '.join(names)}; {args.size_mib} MiB per transfer, "
                  f"best of {args.repeat} after a warm-up; baselines measured in the same run between the same two "
                  "processes" + (f"; options on both sides: {options}" if options else ""))
    from ._bench import idle_lateness
    from ._run import run
    from ._ticker import fd_ticker_available

    idle = run(idle_lateness())
    idle_fd = run(idle_lateness(fd=True)) if fd_ticker_available() else None
    try:
        rows = main_bench(names, total, args.repeat, options)
    except LLMParamInvalid as e:  # raised by this side's initialize, before the peer process starts
        console.print(f"[red]kvflow bench: {e}")
        return 2
    table = Table(title="kvflow vs raw baseline (ratio: higher is better for kvflow)")
    for col in ("transport", "op", "block", "kvflow", "baseline", "baseline figure", "ratio", "with ticker",
                "late ms here", "late ms peer", "fd late ms here", "fd late ms peer"):
        table.add_column(col)
    for r in format_rows(rows):
        table.add_row(*r)
    console.print(table)
    console.print(f"with ticker: GiB/s while a 1 ms ticker sleeps on both sides' event loops; late ms: worst / p99 "
                  f"of its ticks on this side and the peer's, which include the loop's millisecond timer rounding. "
                  f"fd late ms: the same transfer again, ticked by a timerfd, from each expiry to its callback: how "
                  f"long the loop kept I/O waiting. An idle loop here: {idle['worst_ms']:.2f} / {idle['p99_ms']:.2f} ms"
                  + (f", fd {idle_fd['worst_ms']:.2f} / {idle_fd['p99_ms']:.2f} ms" if idle_fd else ""))
    if args.json:
        write_json(args.json, rows, {"size_bytes": total, "repeat": args.repeat, "options": options,
                                     "python": sys.version.split()[0], "machine": platform.machine(),
                                     "cmd": " ".join(sys.argv),
                                     "idle_late_worst_ms": idle["worst_ms"], "idle_late_p99_ms": idle["p99_ms"],
                                     **({"idle_fd_late_worst_ms": idle_fd["worst_ms"],
                                         "idle_fd_late_p99_ms": idle_fd["p99_ms"]} if idle_fd else {})})
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


def _bench_links(args: argparse.Namespace) -> int:
    from ._bench_links import cli

    return cli(args)


def _info(args: argparse.Namespace) -> int:
    from . import __version__
    from ._discovery import available_transports

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


def build_parser() -> argparse.ArgumentParser:
    """The ``kvflow`` command line: every subcommand, every option with its default."""
    parser = argparse.ArgumentParser(prog="kvflow", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log link and transport events")
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                              formatter_class=_HelpFormatter)

    d = add("demo", "prefill and decode processes move a KV cache and check every byte")
    d.add_argument("--layers", type=int, default=32, help="model layers; each has a K and a V tensor")
    d.add_argument("--block-tokens", type=int, default=16, help="tokens per KV cache block")
    d.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    d.add_argument("--head-dim", type=int, default=128, help="elements per head")
    d.add_argument("--prompt-tokens", type=int, default=4096, help="tokens per request (one pushed, one pulled)")
    d.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="element type")
    d.add_argument("--transport", default="shm,ucx,tcp",
                   help="allowed transports, in order of preference ('kvflow info' lists the installed ones)")
    d.set_defaults(fn=_demo)
    b = add("bench", "throughput and latency beside raw baselines measured in the same run")
    b.add_argument("--transport", default="", help="comma list (default: every available transport)")
    b.add_argument("--size-mib", type=int, default=1024, help="MiB per throughput transfer")
    b.add_argument("--repeat", type=int, default=3, help="runs per row after a warm-up; the best is shown")
    b.add_argument("--json", help="also write the rows as JSON to this path")
    b.add_argument("--plot", help="also draw throughput against block size as a PNG")
    b.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an initialize option of both sides, e.g. kvflow.tcp.NativePump=1 (repeatable)")
    b.set_defaults(fn=_bench)
    lw = add("bench-layerwise", "layer-wise overlapped push vs compute-then-push, exposed time")
    lw.add_argument("--transport", default="", help="comma list (default: shm and tcp where available)")
    lw.add_argument("--layers", type=int, default=32, help="layers pushed per request (1..512)")
    lw.add_argument("--layer-mib", type=float, default=4.0, help="K+V bytes per layer, in MiB")
    lw.add_argument("--compute-ms", default="", help="comma list of per-layer compute times in ms "
                    "(default: 1x and 2x the measured one-layer transfer)")
    lw.add_argument("--repeat", type=int, default=5, help="runs per row; the median is shown")
    lw.add_argument("--json", help="also write the rows as JSON to this path")
    lw.set_defaults(fn=_bench_layerwise)
    bs = add("bench-sync", "4 KiB pull latency through kvflow.sync beside the async API")
    from ._bench_sync import add_arguments

    add_arguments(bs)
    bs.set_defaults(fn=_bench_sync)
    bl = add("bench-links", "a link storm to one listener, then the CPU and memory its idle links cost")
    from ._bench_links import add_arguments as add_links_arguments

    add_links_arguments(bl)
    bl.set_defaults(fn=_bench_links)
    i = add("info", "version, event loop and every transport with ok or the reason")
    i.add_argument("--json", action="store_true", help="print the same as JSON")
    i.set_defaults(fn=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvflow`` console script."""
    args = build_parser().parse_args(argv)
    shadow = shadowing_kvflow()
    if shadow:
        print(f"kvflow: warning: {shadow}", file=sys.stderr)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
