"""Print kvflow's module import graph and fail on a cycle (module-level imports, TYPE_CHECKING included).

    python scripts/import_graph.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvflow"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str) -> set[str]:
    """Every kvflow module that ``path`` imports at any depth (function-level imports included)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("kvflow"):
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvflow"))
    out.discard(name)
    return out


def main() -> int:
    graph = {module_name(p): imports(p, module_name(p)) for p in sorted(ROOT.rglob("*.py"))}
    for mod, deps in sorted(graph.items()):
        print(f"{mod}: {', '.join(sorted(d for d in deps if d in graph)) or '-'}")
    # cycles among the implementation modules (a package __init__ re-exporting its modules is not one)
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in graph.get(m, ()):
            if d not in graph or d in ("kvflow", "kvflow.testing"):
                continue
            if seen.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m)
    for c in cycles:
        print("CYCLE:", " -> ".join(c))
    print(f"{len(graph)} modules, {len(cycles)} cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
