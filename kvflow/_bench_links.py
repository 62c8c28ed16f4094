"""``kvflow bench-links`` / ``python -m kvflow._bench_links``: a link storm, then the idle cost of the links.

One listener process (one :class:`kvflow.LlmDataDist`) and ``--procs`` linker processes, which
hold ``--links`` linking instances between them (one ``LlmDataDist`` and one link each). Every
instance calls ``link_llm_clusters`` to the listener at the same moment. The storm figure is the
time from that moment until the last link was made, with each link's own time (p50, p99) and how
many attempts the busy listener asked to be retried. Then nothing happens for ``--idle-s`` seconds,
and the listener reports the CPU it used meanwhile (``getrusage``, as % of one core, and the
kernel's part of it) and its RSS growth per link since it started listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import resource
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ._datadist import LlmDataDist
from ._options import option_pairs
from ._proc import PeerProcess, recv_from_parent
from ._status import LLMStatusCode
from ._types import ClusterInfo, IpInfo, LlmRole
from .testing import _inspect as inspect

LISTENER_CLUSTER = 1
FIRST_LINKER = 1000
_START_S = 120.0  # bound on starting the processes and initializing every instance


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def raise_fd_limit(need: int) -> None:
    """Raise the soft limit on open files to ``need`` (at most the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def listener_main(conn: Connection) -> None:
    """Child: the listener. Answers ``count``, ``idle`` (seconds) and ``stop``."""
    cfg = conn.recv()
    raise_fd_limit(4 * cfg["links"] + 256)
    logging.getLogger("kvflow").addHandler(logging.NullHandler())  # the busy warnings are counted, not printed
    rss0 = _rss()
    async with LlmDataDist(LISTENER_CLUSTER, LlmRole.PROMPT, options={
            "llm.ListenIpInfo": "127.0.0.1:0", "kvflow.MaxLinks": str(max(1024, cfg["links"])),
            **cfg["options"]}) as dd:
        conn.send({"address": dd.listen_address})
        cpu_listening = _cpu_s()
        while True:
            msg = await recv_from_parent(conn)
            if msg == "count":
                busy = inspect.busy_answers(dd)
                conn.send({"held": sum(1 for info in dd.links().values() if info.state == "linked"),
                           "busy_answers": busy, "cpu_s": _cpu_s() - cpu_listening})
            elif isinstance(msg, dict) and "idle" in msg:
                n = sum(1 for info in dd.links().values() if info.state == "linked")
                cpu0, sys0, t0 = _cpu_s(), _sys_s(), time.monotonic()
                await asyncio.sleep(msg["idle"])
                cpu, sys_cpu, wall = _cpu_s() - cpu0, _sys_s() - sys0, time.monotonic() - t0
                alive = sum(1 for info in dd.links().values() if info.state == "linked")
                conn.send({"links": n, "alive_after": alive, "cpu_s": cpu, "sys_s": sys_cpu, "wall_s": wall,
                           "rss_growth": _rss() - rss0, "stats": dd.stats().get("link_events")})
            else:
                return


class _FailedLinks(logging.Handler):
    """Keeps the message of every ``link_failed`` event."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "kvflow_event", None) == "link_failed":
            fields = getattr(record, "kvflow", {})
            self.errors.append(str(fields.get("error")))


async def linker_main(conn: Connection) -> None:
    """Child: ``n`` instances that link to the listener together when told; answers ``idle`` and ``stop``."""
    cfg = conn.recv()
    raise_fd_limit(4 * cfg["n"] + 256)
    failed = _FailedLinks()  # kept and reported, not printed
    logging.getLogger("kvflow").addHandler(failed)
    dds = [LlmDataDist(cfg["first"] + i, LlmRole.DECODER) for i in range(cfg["n"])]
    try:
        for dd in dds:
            await dd.initialize(dict(cfg["options"]))
        conn.send("ready")
        go = await recv_from_parent(conn)
        if not isinstance(go, dict):
            return
        at = go["at"]
        target = [ClusterInfo(LISTENER_CLUSTER, [IpInfo(*cfg["address"])])]
        await _sleep_until(at)

        async def one(dd: LlmDataDist) -> tuple[int, float]:
            ret = await dd.link_llm_clusters(target, cfg["timeout_ms"])
            return int(ret[0]), time.monotonic() - at

        results = await asyncio.gather(*(one(dd) for dd in dds))
        conn.send({"links": [[code, took] for code, took in results], "errors": failed.errors})
        await _idle_until_stopped(conn)
    finally:
        await asyncio.gather(*(dd.finalize() for dd in dds), return_exceptions=True)


async def _idle_until_stopped(conn: Connection) -> None:
    """Answer ``idle`` requests (CPU used over that many seconds) until told anything else."""
    while True:
        msg = await recv_from_parent(conn)
        if isinstance(msg, dict) and "idle" in msg:
            cpu0, t0 = _cpu_s(), time.monotonic()
            await asyncio.sleep(msg["idle"])
            conn.send({"cpu_s": _cpu_s() - cpu0, "wall_s": time.monotonic() - t0})
        else:
            return


async def run_bench_links(links: int, procs: int, timeout_ms: int, idle_s: float,
                          options: dict[str, str]) -> dict[str, Any]:
    """Run the storm and the idle measurement; the figures as plain data."""
    listener = PeerProcess(listener_main)
    linkers: list[PeerProcess] = []
    try:
        listener.send({"links": links, "options": options})
        address = tuple((await listener.recv(_START_S))["address"])
        per = [links // procs + (1 if i < links % procs else 0) for i in range(procs)]
        first = FIRST_LINKER
        for n in per:
            p = PeerProcess(linker_main)
            p.send({"n": n, "first": first, "address": address, "timeout_ms": timeout_ms, "options": options})
            linkers.append(p)
            first += n
        for p in linkers:
            if await p.recv(_START_S) != "ready":
                raise RuntimeError(f"linker process {p.pid} did not start")
        at = time.monotonic() + 0.5
        for p in linkers:
            p.send({"at": at})
        reports = [await p.recv(timeout_ms / 1000 + 60) for p in linkers]
        results = [r for rep in reports for r in rep["links"]]
        errors = [e for rep in reports for e in rep["errors"]]
        codes = [code for code, _ in results]
        took = np.array([t for _, t in results])
        ok = took[np.array(codes) == 0]
        listener.send("count")
        counts = await listener.recv(30)
        # a dialer that gave up at its deadline mid-handshake closes its connection; the listener drops
        # that link when it reads the close, which a loaded machine may not have done yet: let it settle
        settle = time.monotonic() + 5.0
        while counts["held"] != len(ok) and time.monotonic() < settle:
            await asyncio.sleep(0.1)
            listener.send("count")
            counts = await listener.recv(30)
        idle: dict[str, Any] = {}
        if idle_s > 0:
            for p in linkers:
                p.send({"idle": idle_s})
            listener.send({"idle": idle_s})
            idle = await listener.recv(idle_s + 60)
            linker_idle = [await p.recv(idle_s + 60) for p in linkers]
            idle["linkers_cpu_pct"] = [round(100 * r["cpu_s"] / r["wall_s"], 2) for r in linker_idle]
        failed: dict[str, int] = {}
        for code in codes:
            if code:
                name = LLMStatusCode.of(code).name
                failed[name] = failed.get(name, 0) + 1
        res: dict[str, Any] = {
            "links": links, "procs": procs, "timeout_ms": timeout_ms, "options": options,
            "linked": len(ok), "failed": failed, "held_by_listener": counts["held"],
            "busy_answers": counts["busy_answers"], "listener_cpu_s": counts["cpu_s"],
            "errors": sorted(set(errors))[:5],
            "codes_and_times": results,
            "storm_s": float(ok.max()) if len(ok) else None,
            "link_p50_s": float(np.percentile(ok, 50)) if len(ok) else None,
            "link_p99_s": float(np.percentile(ok, 99)) if len(ok) else None,
        }
        if idle:
            res["idle_s"] = idle["wall_s"]
            res["idle_links"] = idle["links"]
            res["idle_links_alive_after"] = idle["alive_after"]
            res["idle_cpu_pct"] = 100 * idle["cpu_s"] / idle["wall_s"]
            res["idle_sys_pct"] = 100 * idle["sys_s"] / idle["wall_s"]
            res["rss_per_link_kib"] = idle["rss_growth"] / max(1, idle["links"]) / 1024
            res["linkers_idle_cpu_pct"] = idle["linkers_cpu_pct"]
        return res
    finally:
        for p in linkers:
            p.stop(30)
        listener.stop(30)


def format_result(res: dict[str, Any]) -> str:
    """The figures, as lines for a terminal."""
    lines = [f"link storm: {res['links']} instances in {res['procs']} processes -> one listener, "
             f"timeout {res['timeout_ms']} ms, options {res['options'] or '{}'}",
             f"  linked {res['linked']}/{res['links']}; failed {res['failed'] or 'none'}; "
             f"the listener holds {res['held_by_listener']}, answered busy {res['busy_answers']} times and used "
             f"{res['listener_cpu_s']:.2f} s of CPU"]
    lines += [f"  failure: {e}" for e in res["errors"]]
    if res["storm_s"] is not None:
        lines.append(f"  all linked after {res['storm_s']:.2f} s; per link p50 {res['link_p50_s']:.2f} s, "
                     f"p99 {res['link_p99_s']:.2f} s")
    if "idle_cpu_pct" in res:
        lines.append(f"idle: the listener with {res['idle_links']} links used {res['idle_cpu_pct']:.2f} % of one core "
                     f"({res['idle_sys_pct']:.2f} % in the kernel) over {res['idle_s']:.1f} s "
                     f"({res['idle_links_alive_after']} links alive after); "
                     f"RSS {res['rss_per_link_kib']:.1f} KiB per link; linker processes "
                     f"{', '.join(f'{c:.2f}' for c in res['linkers_idle_cpu_pct'])} % each")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvflow bench-links``."""
    p.add_argument("--links", type=int, default=1024, help="linking instances, one link each")
    p.add_argument("--procs", type=int, default=4, help="processes the linking instances are spread over")
    p.add_argument("--timeout-ms", type=int, default=30000, help="each link_llm_clusters call's timeout")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle links measured (0: skip)")
    p.add_argument("--transport", default="tcp", help="kvflow.Transports of every instance")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="another initialize option of every instance (repeatable)")
    p.add_argument("--json", help="also write the figures as JSON to this path")


def cli(args: argparse.Namespace) -> int:
    """``kvflow bench-links`` and ``python -m kvflow._bench_links``: print (and write) the figures."""
    from ._run import run

    if not (1 <= args.procs <= args.links <= 65536):
        print("bench-links: need 1 <= --procs <= --links <= 65536", file=sys.stderr)
        return 2
    options = {"kvflow.Transports": args.transport} if args.transport else {}
    try:
        options.update(option_pairs(args.option))
    except ValueError as e:
        print(f"bench-links: {e}", file=sys.stderr)
        return 2
    res = run(run_bench_links(args.links, args.procs, args.timeout_ms, args.idle_s, options))
    print(format_result(res))
    if args.json:
        meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cmd": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **{k: v for k, v in res.items() if k != "codes_and_times"}}, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if res["linked"] == res["links"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m kvflow._bench_links [--links 1024] [--procs 4] [--idle-s 20] [--json PATH]``."""
    parser = argparse.ArgumentParser(prog="python -m kvflow._bench_links", description=__doc__)
    add_arguments(parser)
    return cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
