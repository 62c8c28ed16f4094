"""Alternate ``pull_latency.py`` between two checkouts, both sides of the link from each.

    python scripts/ab_checkouts.py /tmp/head tcp 6 5000 [push]

Runs ``scripts/pull_latency.py <transport> N`` (or ``push``) with kvflow imported from the given checkout
(``git worktree add /tmp/head <commit>``), then from this one, ``rounds`` times, and prints each
pair. Unlike ``ab_tcp_inline.py`` and ``ab_engine.py``, the serving child runs the same checkout as
the asking side, so a change to the serving side shows. ``PYTHONPATH`` alone does not do this: the
editable install's import hook comes before it, so a ``sitecustomize`` in a temporary folder drops
that hook in both processes. Compare pairs, not runs: a shared host drifts between minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

_HOOK = """import os, sys
tree = os.environ.get("KVFLOW_AB_TREE")
if tree:  # drop the editable install's finder, so that this checkout's kvflow is the one imported
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
    sys.path.insert(0, tree)
"""


def main(other: str, transport: str, rounds: int, n: int, op: list[str]) -> None:
    here = str(Path(__file__).resolve().parents[1])
    script = os.path.join(here, "scripts", "pull_latency.py")
    with tempfile.TemporaryDirectory() as hook:
        Path(hook, "sitecustomize.py").write_text(_HOOK)
        for _ in range(rounds):
            for tree in (other, here):
                env = dict(os.environ, KVFLOW_AB_TREE=tree, PYTHONPATH=hook)
                out = subprocess.run([sys.executable, script, transport, str(n), *op], env=env, capture_output=True,
                                     text=True, timeout=300)
                last = (out.stdout.strip().splitlines() or [out.stderr.strip()[-200:]])[-1]
                print(f"{tree}: {last}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:6])
