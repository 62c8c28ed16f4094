"""The pytest plugin as a user gets it: found through the ``pytest11`` entry point, in a fresh pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

from kvflow.testing import _capabilities


def test_registered_through_the_pytest11_entry_point() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert eps.get("kvflow") == "kvflow.testing.pytest_plugin"


def _run_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    # no ini file of ours: the user's project has its own (strict markers, strict asyncio)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = "
                                         "function\naddopts = --strict-markers -p no:cacheprovider\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-rs", "-q", str(tmp_path), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)


def test_fixtures_and_markers_in_a_users_project(tmp_path: Path) -> None:
    res = _run_pytest(tmp_path, '''
        import pytest

        def test_ports(free_tcp_port, free_tcp_port_factory):
            ports = {free_tcp_port_factory() for _ in range(5)}
            assert len(ports) == 5 and 0 < free_tcp_port < 65536

        @pytest.mark.asyncio
        async def test_pair(kvflow_pair):
            await kvflow_pair.dd.pull_kv_blocks(kvflow_pair.remote, kvflow_pair.cache, [1], [0])
            remote = await kvflow_pair.remote_read()
            assert bytes(kvflow_pair.blocks(kvflow_pair.local[3])[0]) == bytes(kvflow_pair.blocks(remote[3])[1])

        @pytest.mark.asyncio
        async def test_proxy(kvflow_pair, fault_proxy):
            proxy = await fault_proxy(kvflow_pair.address)
            assert proxy.address[1] != kvflow_pair.address[1]

        @pytest.mark.requires_transport("no-such-transport")
        def test_needs_a_transport():
            raise AssertionError("must be skipped")

        @pytest.mark.requires_rdma
        @pytest.mark.requires_gpu
        def test_needs_hardware():
            pass
    ''')
    out = res.stdout + res.stderr
    assert "transport 'no-such-transport' is not installed" in out, out
    rdma, gpu = _capabilities.rdma_missing(), _capabilities.gpu_missing()
    if rdma or gpu:
        assert any(f"requires_{what}: {r}" in out for what, r in (("rdma", rdma), ("gpu", gpu)) if r), out
    expected_skips = 1 + (1 if (rdma or gpu) else 0)
    assert f"{5 - expected_skips} passed, {expected_skips} skipped" in out, out
    assert res.returncode == 0, out


def test_conformance_fixture_fails_for_an_uninstalled_transport(tmp_path: Path) -> None:
    res = _run_pytest(tmp_path, '''
        import pytest

        @pytest.mark.asyncio
        async def test_mine(transport_conformance):
            await transport_conformance("not-installed-anywhere")
    ''')
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "no entry point 'not-installed-anywhere' in the 'kvflow.transports' group" in out, out


def test_capability_probes_give_one_line_reasons() -> None:
    for reason in (_capabilities.rdma_missing(), _capabilities.gpu_missing(),
                   _capabilities.transport_missing("no-such-transport")):
        assert reason is None or (reason and "\n" not in reason)
    assert _capabilities.transport_missing("tcp") is None
