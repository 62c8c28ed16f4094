"""``kvflow bench --plot``: the PNG renders, from synthetic rows and from a small real bench run."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow._bench import Row

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'kvflow[plot]')")

from kvflow._plot import DPI, HEIGHT, WIDTH, block_bytes, panels, plot_rows

PIXELS = (int(WIDTH * DPI), int(HEIGHT * DPI))


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header (signature, then the IHDR chunk)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_block_labels() -> None:
    assert block_bytes("16 KiB scattered") == 16 << 10
    assert block_bytes("4 MiB") == 4 << 20
    assert block_bytes("lat") is None


def test_plot_from_synthetic_rows(tmp_path: Path) -> None:
    rows = [Row(t, op, f"{b} scattered" if b == "16 KiB" else b, v * k, v * k * 1.2, "GiB/s")
            for t, k in (("tcp", 1.0), ("shm", 4.0)) for op in ("pull", "push")
            for b, v in (("16 KiB", 0.5), ("256 KiB", 1.5), ("4 MiB", 2.5))]
    rows += [Row("tcp", "4 KiB pull p50", "4 KiB", 160.0, 60.0, "us"),
             Row("tcp", "4 KiB pull p99", "4 KiB", 260.0, 80.0, "us")]
    assert panels(rows) == ["throughput", "latency"]
    for r in rows[:6]:  # ticked rows: the lateness panel appears
        r.ticked, r.late_worst_ms, r.late_p99_ms, r.peer_late_worst_ms, r.peer_late_p99_ms = 1.0, 3.0, 0.4, 1.2, 0.2
        r.fd_late_worst_ms, r.fd_late_p99_ms, r.peer_fd_late_worst_ms, r.peer_fd_late_p99_ms = 1.0, 0.2, 0.6, 0.1
    assert panels(rows) == ["throughput", "latency", "lateness"]
    out = tmp_path / "bench.png"
    assert plot_rows(rows, str(out)) == str(out)
    assert png_size(out) == PIXELS
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert img.shape[:2] == (PIXELS[1], PIXELS[0])
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_plot_without_rows_still_renders(tmp_path: Path) -> None:
    out = tmp_path / "empty.png"
    plot_rows([], str(out))
    assert png_size(out) == PIXELS


def test_kvflow_bench_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    js = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "kvflow._cli", "bench", "--transport", "tcp", "--size-mib", "16",
                          "--repeat", "1", "--plot", str(out), "--json", str(js)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert png_size(out) == PIXELS
    assert out.stat().st_size > 10_000
