"""The type gate and the shape of the code: mypy over kvflow and both plugins, no bare ``Any`` in a
public signature, no import cycle, and plugins that import only the public contract."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import kvflow
import kvflow.sync
import kvflow.transport

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = [ROOT / "transports" / f"kvflow-{n}" / "src" / f"kvflow_{n}" for n in ("shm", "ucx")]


def test_mypy_passes_on_kvflow_and_the_plugins() -> None:
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "kvflow",
                        *map(str, PLUGINS)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def _bare_any(module: object) -> list[str]:
    out = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        members = [(f"{name}.{n}", m) for n, m in vars(obj).items() if not n.startswith("_") or n == "__init__"] \
            if inspect.isclass(obj) else [(name, obj)]
        for qual, fn in members:
            fn = getattr(fn, "__func__", fn)
            if not inspect.isfunction(fn):
                continue
            sig = inspect.signature(fn)
            out += [f"{qual}({p.name})" for p in sig.parameters.values() if p.annotation == "Any"]
            if sig.return_annotation == "Any":
                out.append(f"{qual} -> Any")
    return out


def test_no_bare_any_in_public_signatures() -> None:
    assert _bare_any(kvflow) + _bare_any(kvflow.transport) + _bare_any(kvflow.sync) == []


def test_no_import_cycle() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.rstrip().endswith("0 cycles"), r.stdout[-300:]


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda p: p.name)
def test_plugins_import_only_the_public_contract(plugin: Path) -> None:
    private = []
    for path in plugin.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            private += [f"{path.name}: {n}" for n in names
                        if n.startswith("kvflow") and n not in ("kvflow", "kvflow.transport")]
    assert private == []


def test_no_module_is_over_about_600_lines() -> None:
    long = {p.name: n for p in (ROOT / "kvflow").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 650 and p.name != "_tcp.py"}
    assert long == {}
