"""The main job, the examples and the command line, run as a user would (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_kvflow_demo_small_shape() -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "demo", "--layers", "4", "--prompt-tokens", "512",
             "--transport", "tcp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bytes checked" in r.stdout and "push" in r.stdout and "GiB/s" in r.stdout


@pytest.mark.parametrize("script", ["typical_cache_transfer.py", "blocks_cache_transfer.py"])
def test_examples(script: str) -> None:
    r = _run(sys.executable, str(ROOT / "examples" / script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte checked" in r.stdout


def test_info_lists_transports() -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["transports"]["tcp"] == "ok"


def test_bench_tiny_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = _run(sys.executable, "-m", "kvflow._cli", "bench", "--transport", "tcp", "--size-mib", "16", "--repeat", "1",
             "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    ops = {(row["op"], row["block"]) for row in rows}
    assert ("pull", "16 KiB scattered") in ops and ("push", "4 MiB") in ops and ("4 KiB pull p50", "4 KiB") in ops
    assert all(row["kvflow"] > 0 and row["raw"] > 0 for row in rows)
    scattered = [row for row in rows if row["baseline"] == "raw socket, scattered"]
    assert {row["op"] for row in scattered} == {"pull", "push"}
    assert all(row["block"] == "16 KiB scattered" for row in scattered)


def test_ruff_clean() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", "kvflow", "tests", "examples")
    assert r.returncode == 0, r.stdout + r.stderr
