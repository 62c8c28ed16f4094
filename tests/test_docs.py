"""The documentation site builds with ``mkdocs build --strict``: a broken link or nav entry fails CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mkdocs_missing() -> str | None:
    for mod in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (pip install 'kvflow[docs]')"
    return None


def test_every_nav_page_exists() -> None:
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert "index.md" in nav and "reference.md" in nav
    missing = [p for p in nav if not (ROOT / "docs" / p).is_file()]
    assert not missing, f"pages in mkdocs.yml nav but not in docs/: {missing}"


@pytest.mark.skipif(_mkdocs_missing() is not None, reason=str(_mkdocs_missing()))
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    site = tmp_path / "site"
    for page in ("index.html", "testing/index.html", "observability/index.html", "reference/index.html"):
        assert (site / page).is_file(), page
    reference = (site / "reference" / "index.html").read_text()
    for name in ("pull_kv_blocks", "register_prometheus", "check_peer", "KvPair"):
        assert name in reference, f"{name} missing from the generated API reference"
