"""``kvflow bench --plot PATH``: throughput against block size per transport, as a PNG (matplotlib)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)\b")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

#: Pixel size of the figure: 11 x 5 inches at 100 dpi.
WIDTH, HEIGHT, DPI = 11.0, 5.0, 100


def block_bytes(label: str) -> int | None:
    """``"16 KiB scattered"`` -> 16384; None when the label names no size."""
    m = _SIZE.search(label)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _fmt(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}"
    return f"{n} B"


def plot_rows(rows: Sequence[Any], path: str, title: str | None = None) -> str:
    """Draw ``kvflow bench`` rows into a PNG at ``path`` and return ``path``.

    Left: throughput (GiB/s) against block size, one solid line per (transport, op), each with its
    raw baseline dashed in the same colour; a scattered block list is marked with an open marker.
    Middle (when latency rows are present): 4 KiB pull and push latency p50/p99, kvflow beside its
    baseline.
    Right (when rows were ticked): how late a 1 ms ticker fired on both sides' loops (``panels``)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("kvflow bench --plot needs matplotlib: pip install 'kvflow[plot]'") from exc
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    thr = [r for r in rows if r.unit == "GiB/s" and block_bytes(r.block) is not None]
    lat = [r for r in rows if r.unit == "us"]
    late = [r for r in thr if getattr(r, "late_worst_ms", None) is not None]
    fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    names = panels(rows)
    axes = fig.subplots(1, len(names), width_ratios=[{"throughput": 2.2, "latency": 1, "lateness": 1.6}[n]
                                                      for n in names], squeeze=False)[0]
    ax = axes[0]
    axl = axes[names.index("latency")] if "latency" in names else None
    axt = axes[names.index("lateness")] if "lateness" in names else None
    series: dict[tuple[str, str], list[Any]] = {}
    extra: dict[tuple[str, str], list[Any]] = {}  # second baselines of a row (e.g. raw socket, scattered)
    for r in thr:
        second = getattr(r, "baseline", "").endswith(", scattered")
        (extra if second else series).setdefault((r.transport, r.op), []).append(r)
    colors = matplotlib.colormaps["tab10"].colors  # type: ignore[attr-defined]  # a ListedColormap
    sizes: set[int] = set()
    for i, ((transport, op), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: block_bytes(r.block) or 0)
        xs = [block_bytes(r.block) for r in rs]
        sizes.update(x for x in xs if x)
        color = colors[i % len(colors)]
        ax.plot(xs, [r.kvflow for r in rs], "-o", color=color, label=f"kvflow {transport} {op}")
        baseline = getattr(rs[0], "baseline", "raw")
        ax.plot(xs, [r.raw for r in rs], "--", color=color, alpha=0.7, label=f"{baseline} ({transport} {op})")
        for r, x in zip(rs, xs, strict=True):
            if "scattered" in r.block:
                ax.plot([x], [r.kvflow], "o", markersize=11, markerfacecolor="none", color=color)
        for r in extra.get((transport, op), []):
            ax.plot([block_bytes(r.block)], [r.raw], "x", markersize=9, color=color,
                    label=f"{r.baseline} ({transport} {op})")
    if sizes:
        ax.set_xscale("log", base=2)
        ticks = sorted(sizes)
        ax.set_xticks(ticks, [_fmt(t) for t in ticks])
    ax.set_xlabel("block size (bytes per block per tensor; circled: scattered block list)")
    ax.set_ylabel("throughput (GiB/s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    if series:
        ax.legend(fontsize="small", loc="best")
    else:
        ax.text(0.5, 0.5, "no throughput rows", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title or "kvflow bench: throughput against block size")
    if axl is not None:
        # a row against a second baseline of the same figure says which ("awaited", "polled")
        labels = [f"{r.transport}\n{' '.join(r.op.split()[2:])}" + "".join(f"\n{q}" for q in r.baseline.split(", ")[1:])
                  for r in lat]
        pos = list(range(len(lat)))
        w = 0.38
        assert axl is not None
        axl.bar([x - w / 2 for x in pos], [r.kvflow for r in lat], w, label="kvflow", color=colors[0])
        axl.bar([x + w / 2 for x in pos], [r.raw for r in lat], w, label="baseline", color=colors[7])
        axl.set_xticks(pos, labels, fontsize="small")
        axl.set_ylabel("latency (us)")
        axl.set_title("4 KiB pull and push latency")
        axl.legend(fontsize="small")
        axl.grid(True, axis="y", alpha=0.3)
    if axt is not None:
        _lateness(axt, late, colors)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def panels(rows: Sequence[Any]) -> list[str]:
    """The panels ``plot_rows`` draws for ``rows``, left to right."""
    out = ["throughput"]
    if any(r.unit == "us" for r in rows):
        out.append("latency")
    if any(r.unit == "GiB/s" and getattr(r, "late_worst_ms", None) is not None for r in rows):
        out.append("lateness")
    return out


def _lateness(ax: Any, rows: Sequence[Any], colors: Sequence[Any]) -> None:
    """Each throughput row's 1 ms ticker lateness on both sides' loops: worst and p99 of the sleeping
    ticker and, where it ran, p99 of the timerfd one; log scale, with the targets (worst 2 ms, p99
    0.5 ms) as lines."""
    labels = [f"{r.transport} {r.op}\n{r.block}" for r in rows]
    pos = list(range(len(rows)))
    bars = [("worst, this side", "late_worst_ms"), ("worst, peer", "peer_late_worst_ms"),
            ("p99, this side", "late_p99_ms"), ("p99, peer", "peer_late_p99_ms")]
    if any(getattr(r, "fd_late_p99_ms", None) is not None for r in rows):  # the timerfd ticker's pass
        bars += [("p99 timerfd, this side", "fd_late_p99_ms"), ("p99 timerfd, peer", "peer_fd_late_p99_ms")]
    w = 0.8 / len(bars)
    for k, (name, field) in enumerate(bars):
        ax.bar([x + (k - (len(bars) - 1) / 2) * w for x in pos],
               [max(getattr(r, field, None) or 0.0, 0.01) for r in rows], w, label=name, color=colors[k])
    ax.axhline(2.0, color="black", linestyle="--", linewidth=0.8, label="target worst (2 ms)")
    ax.axhline(0.5, color="gray", linestyle=":", linewidth=0.8, label="target p99 (0.5 ms)")
    ax.set_yscale("log")
    ax.set_xticks(pos, labels, fontsize="x-small", rotation=90)
    ax.set_ylabel("tick lateness (ms)")
    ax.set_title("event loop lateness, 1 ms ticker")
    ax.legend(fontsize="x-small")
    ax.grid(True, axis="y", alpha=0.3)
