"""The documentation site builds with ``mkdocs build --strict``: a broken link or nav entry fails CI.
The README's and the quickstart's instructions do what they say: the two-process examples run as
real processes, and the library-only install gives a working core without the test tools."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._docblocks import python_blocks

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
    # Layout (scripts/docs_screenshot.sh shows it): the extra CSS is linked, and the right-hand
    # contents of the API page name the calls instead of repeating whole signatures.
    api = (site / "api" / "index.html").read_text()
    assert "stylesheets/extra.css" in api and (site / "stylesheets" / "extra.css").is_file()
    toc = api[api.index("md-nav--secondary"):]
    toc = toc[:toc.index("</nav>")]
    labels = re.findall(r'<span class="md-ellipsis">\s*(.*?)\s*</span>', toc, re.S)
    assert "register_kv_cache" in labels and "transfer_cache_async" in labels, labels
    assert not [label for label in labels if "(" in label], labels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of stdout, or '' if it printed none within ``timeout`` s or exited."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_two_process_example_runs(page: str, tmp_path: Path) -> None:
    """The page's example, as written but for the port, as the prefill and the decode process: decode
    pulls and checks the bytes, and prefill, which serves on a free loop, stops cleanly on SIGINT."""
    blocks = [b for b in python_blocks(page) if "async def prefill" in b and "async def decode" in b]
    assert len(blocks) == 1, f"{page}: expected one example with both sides, found {len(blocks)}"
    assert "26000" in blocks[0], "the example has one port to change"
    assert not re.search(r"^\s*\.\.\.", blocks[0], re.M), "the example is complete: no '...' statement"
    script = tmp_path / "example.py"
    script.write_text(blocks[0].replace("26000", str(_free_port())))
    # cwd=tmp_path: no kvflow directory beside the script, as for a user
    prefill = subprocess.Popen([sys.executable, str(script), "prefill"], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = _read_line(prefill, 60)
        assert first.startswith("prefill:"), first + (prefill.stderr.read() if prefill.poll() is not None else "")
        decode = subprocess.run([sys.executable, str(script), "decode"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert decode.returncode == 0, decode.stdout + decode.stderr
        assert decode.stdout.startswith("decode:"), decode.stdout
        prefill.send_signal(signal.SIGINT)
        out, err = prefill.communicate(timeout=30)
        assert prefill.returncode == 0, out + err
        assert "Traceback" not in err, err
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


_NETWORK_TROUBLE = ("NewConnectionError", "ConnectTimeout", "Read timed out", "Max retries exceeded",
                    "Temporary failure in name resolution", "Network is unreachable")


#: The fresh venv sees none of this interpreter's path settings (a user's shell has none either).
_CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def _pip(venv_python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(venv_python), "-m", "pip", "install", "--disable-pip-version-check", "--timeout", "30",
                        *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=_CLEAN_ENV)
    if r.returncode != 0 and any(t in r.stdout + r.stderr for t in _NETWORK_TROUBLE):
        pytest.skip(f"the package index cannot be reached: {(r.stdout + r.stderr).strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_library_install_core_then_shm(tmp_path: Path) -> None:
    """README's library-only installs, in a fresh venv from a copy of the sources (what an sdist
    carries): ``pip install .`` gives the core and its three dependencies, no test or docs tool; a
    script beside a directory called kvflow still imports it; ``'.[shm]' ./transports/kvflow-shm``
    adds the shm transport. About 25 s here, most of it pip."""
    t0 = time.monotonic()
    src = tmp_path / "kvflow-src"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "_native.c", "build", "*.egg-info", "tests")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvflow", src / "kvflow", ignore=junk)
    shutil.copytree(ROOT / "transports" / "kvflow-shm", src / "transports" / "kvflow-shm", ignore=junk)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_CLEAN_ENV)
    py = venv / "bin" / "python"

    _pip(py, ".", cwd=src)
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True, timeout=60, env=_CLEAN_ENV)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"kvflow", "msgpack", "numpy", "rich"} <= installed, installed
    tools = {"pytest", "pytest-asyncio", "hypothesis", "ruff", "mkdocs", "matplotlib", "uvloop", "torch",
             "kvflow-shm", "kvflow-ucx", "cffi"}
    assert not installed & tools, f"the core install pulled in {sorted(installed & tools)}"

    # A clone called kvflow beside the script does not hide a regular install (see docs/quickstart.md).
    (tmp_path / "kvflow" / "kvflow").mkdir(parents=True)
    (tmp_path / "check.py").write_text(
        "import importlib.util, kvflow\n"
        "from kvflow import CacheDesc\n"
        "print(kvflow.__file__, kvflow.available_transports(), importlib.util.find_spec('pytest'))\n")
    r = subprocess.run([str(py), "check.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=_CLEAN_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert str(venv) in r.stdout and "{'tcp': 'ok'}" in r.stdout and r.stdout.strip().endswith("None"), r.stdout

    _pip(py, ".[shm]", "./transports/kvflow-shm", cwd=src)
    r = subprocess.run([str(py), "-c", "import kvflow; print(sorted(kvflow.available_transports()))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, env=_CLEAN_ENV)
    assert r.returncode == 0 and r.stdout.strip() == "['shm', 'tcp']", r.stdout + r.stderr
    assert time.monotonic() - t0 < 240


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])
async def test_concepts_two_instances_in_one_process(transport: str) -> None:
    """docs/concepts.md: two instances in one process are allowed and share nothing but the process;
    they link to each other over any transport, and each counts its own caches and transfers."""
    import numpy as np

    import kvflow
    from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole

    status = kvflow.available_transports().get(transport, "not installed")
    if status != "ok":
        pytest.skip(f"{transport}: {status}")
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_INT32, shape=[8, 16])
    a_kv = [np.arange(128, dtype=np.int32).reshape(8, 16) + 1000 * t for t in range(2)]
    b_kv = [np.zeros((8, 16), np.int32) for _ in range(2)]
    opts = {"kvflow.Transports": transport}
    async with LlmDataDist(1, LlmRole.PROMPT, options={**opts, "llm.ListenIpInfo": "127.0.0.1:0"}) as a, \
            LlmDataDist(2, LlmRole.DECODER, options=opts) as b:
        ca = await a.register_kv_cache(desc, a_kv)
        cb = await b.register_kv_cache(desc, b_kv)
        assert ca.cache_id == cb.cache_id == 1  # ids are counted per instance
        assert b.listen_address is None and a.listen_address is not None
        rets = await b.link_llm_clusters([ClusterInfo(1, [IpInfo(*a.listen_address)])])
        assert rets == [kvflow.LLMStatusCode.LLM_SUCCESS]
        assert b.link_info(1).transport == transport
        await b.pull_kv_blocks(CacheIndex(1, ca.cache_id), cb, [0, 1], [1, 0])
        assert (b_kv[0][1] == a_kv[0][0]).all() and (b_kv[1][0] == a_kv[1][1]).all()
        assert b_kv[0][2:].sum() == 0  # nothing else landed
        assert b.stats()["total"]["transfers"] == 1 and a.stats()["total"]["transfers"] == 0
