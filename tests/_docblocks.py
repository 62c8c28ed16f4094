"""The python code blocks of a docs page, and running one as a script (for the tests that keep
docs examples runnable as written)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(page: str) -> list[str]:
    """Every ```python block of ``page`` (a path under the repository root), in order."""
    return re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M)


def run_as_script(code: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` written to a file in ``tmp_path`` and run there by this interpreter."""
    script = tmp_path / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)
