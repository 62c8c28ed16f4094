"""The main job, the examples and the command line, run as a user would (real processes)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow._cli import build_parser, shadowing_kvflow

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_kvflow_demo_small_shape() -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "demo", "--layers", "4", "--prompt-tokens", "512",
             "--transport", "tcp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bytes checked" in r.stdout and "push" in r.stdout and "GiB/s" in r.stdout
    # The bars and the table show the same time per step; setup is in neither, and said so.
    steps = (("push layer by layer", "push (layer by layer)"), ("pull blocks", "pull (block list)"))
    for bar_label, row_label in steps:
        bar = re.search(re.escape(bar_label) + r".*?(\d+\.\d ms)", r.stdout)
        row = re.search(re.escape(row_label) + r".*?(\d+\.\d ms)", r.stdout)
        assert bar and row and bar.group(1) == row.group(1), r.stdout
    assert "setup before it" in r.stdout and "is in neither" in r.stdout


def test_demo_unknown_transport_one_line() -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "demo", "--transport", "bogus", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "'bogus'" in lines[0] and "tcp (ok)" in lines[0], lines[0]
    assert "Traceback" not in lines[0] and "EOFError" not in lines[0]


def test_help_lists_every_command_and_default() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"demo", "bench", "bench-layerwise", "bench-sync", "bench-links", "info"} <= set(commands)
    r = _run(sys.executable, "-m", "kvflow._cli", "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "``" not in r.stdout and ":func:" not in r.stdout, r.stdout
    for name in commands:
        assert re.search(rf"^\s+{re.escape(name)}\b", r.stdout, re.M), f"{name} missing from kvflow --help"
    for name, sub in commands.items():
        text = sub.format_help()
        assert "``" not in text, (name, text)
        for action in sub._actions:
            if action.default in (None, "", False, argparse.SUPPRESS) or not action.option_strings:
                continue
            assert action.help, f"kvflow {name} {action.option_strings[0]} has no help"
            shown = " ".join(text.split())  # argparse wraps lines
            assert f"(default: {action.default})" in shown or "default" in action.help, (name, action.dest, text)


def test_clone_named_kvflow_beside_a_script(tmp_path: Path) -> None:
    """A directory called kvflow without __init__.py (a clone of the repository) beside a script: the
    CLI, run from there, warns exactly when the script's ``import kvflow`` would not find this package."""
    clone = tmp_path / "kvflow"
    (clone / "kvflow").mkdir(parents=True)
    (clone / "README.md").write_text("# kvflow\n")
    (tmp_path / "script.py").write_text("from kvflow import CacheDesc\nprint('imported', CacheDesc.__module__)\n")
    script = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    # -P: no directory first on sys.path, as for the installed `kvflow` console script
    cli = subprocess.run([sys.executable, "-P", "-m", "kvflow._cli", "info"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    if script.returncode == 0:  # a regular install: found after the clone on sys.path, and wins
        assert "imported kvflow" in script.stdout
        assert "warning" not in cli.stderr, cli.stderr
    else:  # an editable install: its finder runs only after sys.path, where the clone already matched
        assert "cannot import name 'CacheDesc' from 'kvflow' (unknown location)" in script.stderr, script.stderr
        assert f"imports {clone} as an empty 'kvflow' namespace package" in cli.stderr, cli.stderr
        assert "kvflow-src" in cli.stderr
    assert shadowing_kvflow(ROOT) is None  # the checkout itself holds the real package


@pytest.mark.parametrize("script", ["typical_cache_transfer.py", "blocks_cache_transfer.py"])
def test_examples(script: str) -> None:
    r = _run(sys.executable, str(ROOT / "examples" / script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte checked" in r.stdout


def test_info_lists_transports() -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "info", "--json")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    info = json.loads(r.stdout)
    assert info["transports"]["tcp"] == "ok"


def test_bench_tiny_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = _run(sys.executable, "-m", "kvflow._cli", "bench", "--transport", "tcp", "--size-mib", "16", "--repeat", "1",
             "--option", "kvflow.tcp.NativePump=1", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text())["meta"]["options"] == {"kvflow.tcp.NativePump": "1"}
    rows = json.loads(out.read_text())["rows"]
    ops = {(row["op"], row["block"]) for row in rows}
    assert ("pull", "16 KiB scattered") in ops and ("push", "4 MiB") in ops and ("4 KiB pull p50", "4 KiB") in ops
    assert all(row["kvflow"] > 0 and row["raw"] > 0 for row in rows)
    scattered = [row for row in rows if row["baseline"] == "raw socket, scattered"]
    assert {row["op"] for row in scattered} == {"pull", "push"}
    assert all(row["block"] == "16 KiB scattered" for row in scattered)
    # the 4 KiB pull latency stands beside a blocking, an awaited and a polled raw exchange; the push
    # latency beside the blocking one
    lat_bases = {(row["op"], row["baseline"]) for row in rows if row["unit"] == "us"}
    assert {("4 KiB pull p50", "raw socket"), ("4 KiB pull p50", "raw socket, awaited"),
            ("4 KiB pull p50", "raw socket, polled"), ("4 KiB pull p99", "raw socket, polled"),
            ("4 KiB push p50", "raw socket, a read"), ("4 KiB push p99", "raw socket, a read")} <= lat_bases
    # every throughput row also ran with a 1 ms ticker on both loops and says how late it fired
    for row in rows:
        if row["unit"] == "GiB/s":
            assert row["ticked"] > 0, row
            assert row["late_worst_ms"] >= row["late_p99_ms"] >= 0, row
            assert row["peer_late_worst_ms"] >= row["peer_late_p99_ms"] >= 0, row
            # and again with a timerfd ticker on both loops (Linux)
            assert row["fd_late_worst_ms"] >= row["fd_late_p99_ms"] >= 0, row
            assert row["peer_fd_late_worst_ms"] >= row["peer_fd_late_p99_ms"] >= 0, row
        else:
            assert row["ticked"] is None and row["fd_late_p99_ms"] is None, row
    meta = json.loads(out.read_text())["meta"]
    assert meta["idle_late_worst_ms"] >= meta["idle_late_p99_ms"] >= 0
    assert meta["idle_fd_late_worst_ms"] >= meta["idle_fd_late_p99_ms"] >= 0
    assert "with ticker" in r.stdout


@pytest.mark.parametrize("option, says", [("kvflow.tcp.NativePump", "expected KEY=VALUE"),
                                          ("kvflow.tcp.NativePump=7", "LLM_PARAM_INVALID"),
                                          ("kvflow.Nonsense=1", "unknown option")])
def test_bench_refuses_a_bad_option_before_it_starts_the_peer(option: str, says: str) -> None:
    r = _run(sys.executable, "-m", "kvflow._cli", "bench", "--transport", "tcp", "--option", option)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in " ".join(r.stdout.split()), r.stdout
    assert "Traceback" not in r.stderr and "SpawnProcess" not in r.stderr, r.stderr


def test_ruff_clean() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", "kvflow", "tests", "examples")
    assert r.returncode == 0, r.stdout + r.stderr
