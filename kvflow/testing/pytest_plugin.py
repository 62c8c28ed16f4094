"""kvflow's pytest plugin, registered through the ``pytest11`` entry point (installing kvflow enables it).

Fixtures:

- ``free_tcp_port`` / ``free_tcp_port_factory``: TCP ports on 127.0.0.1 that were free a moment ago.
- ``kvflow_pair`` (async): a decode ``LlmDataDist`` here, linked to a prefill ``LlmDataDist`` in a
  separate process, each with a registered cache (:class:`kvflow.testing.KvPair`). Configure it with
  the ``kvflow_pair_config`` fixture (override it) or the ``kvflow_pair(...)`` marker.
- ``fault_proxy`` (async): a factory, ``await fault_proxy(target)`` starts a
  :class:`kvflow.testing.FaultProxy` to ``target``; every proxy is closed after the test.
- ``transport_conformance``: ``await transport_conformance("name")`` runs
  :func:`kvflow.testing.check_transport`, skipping (with the reason) where the transport cannot run.

Markers (skips say why): ``requires_rdma``, ``requires_gpu``, ``requires_transport(name)``.

Async fixtures need pytest-asyncio; in its strict mode mark async tests ``@pytest.mark.asyncio``.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from ._capabilities import gpu_missing, rdma_missing, transport_missing
from ._pair import KvPair, PairConfig, open_pair

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the async fixtures then skip with the reason
    pytest_asyncio = None  # type: ignore[assignment]

_MARKERS = (
    "requires_rdma: needs an RDMA device with an ACTIVE port (skipped otherwise, with the reason)",
    "requires_gpu: needs a CUDA GPU (nvidia-smi or torch.cuda; skipped otherwise, with the reason)",
    "requires_transport(name): needs kvflow transport `name` to be installed and able to run here",
    "kvflow_pair(**fields): PairConfig fields for this test's kvflow_pair (desc, transport, options, ...)",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers():
        reason = None
        if mark.name == "requires_rdma":
            reason = rdma_missing()
        elif mark.name == "requires_gpu":
            reason = gpu_missing()
        elif mark.name == "requires_transport":
            names = mark.args or (mark.kwargs.get("name"),)
            for name in names:
                reason = reason or transport_missing(str(name))
        if reason:
            pytest.skip(f"{mark.name}: {reason}")


# ---------------------------------------------------------------------- ports
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.fixture
def free_tcp_port_factory() -> Callable[[], int]:
    """Call it for free TCP ports on 127.0.0.1; never the same port twice in one test."""
    given: set[int] = set()

    def factory() -> int:
        for _ in range(100):
            port = _free_port()
            if port not in given:
                given.add(port)
                return port
        raise RuntimeError("no new free port after 100 tries")

    return factory


# ---------------------------------------------------------------------- the pair
@pytest.fixture
def kvflow_pair_config() -> PairConfig:
    """The default ``kvflow_pair`` configuration; override this fixture to change it for a module."""
    return PairConfig()


def _pair_config(request: pytest.FixtureRequest, base: PairConfig) -> PairConfig:
    mark = request.node.get_closest_marker("kvflow_pair")
    if mark is None:
        return base
    if mark.args:
        raise TypeError("kvflow_pair marker: use keyword arguments (PairConfig fields)")
    return dataclasses.replace(base, **mark.kwargs)


def _conformance_runner() -> Callable[..., Awaitable[None]]:
    async def run(name: str, *, options: dict[str, str] | None = None, seed: int = 0,
                  timeout: float = 300.0) -> None:
        from .._discovery import available_transports
        from ._conformance import check_transport

        state = available_transports().get(name)
        if state is None:
            pytest.fail(f"transport {name!r} is not installed: no entry point {name!r} in the "
                        f"'kvflow.transports' group (is the distribution installed?)")
        if state != "ok":
            pytest.skip(f"{name}: {state}")
        await check_transport(name, options=options, seed=seed, timeout=timeout)

    return run


@pytest.fixture
def transport_conformance() -> Callable[..., Awaitable[None]]:
    """``await transport_conformance(name, options=None, seed=0, timeout=300)``: the conformance
    suite for transport ``name``; skips with the transport's reason where it cannot run here."""
    return _conformance_runner()


if pytest_asyncio is not None:

    @pytest_asyncio.fixture
    async def kvflow_pair(request: pytest.FixtureRequest, kvflow_pair_config: PairConfig) -> AsyncIterator[KvPair]:
        """A local decode LlmDataDist linked to a prefill LlmDataDist in a child process (see KvPair)."""
        pair = await open_pair(_pair_config(request, kvflow_pair_config))
        try:
            yield pair
        finally:
            await pair.close()

    @pytest_asyncio.fixture
    async def fault_proxy() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
        """``proxy = await fault_proxy((host, port), **kwargs)``: a started FaultProxy to that address."""
        from ._proxy import FaultProxy

        proxies: list[FaultProxy] = []

        async def start(target: tuple[str, int], **kwargs: Any) -> FaultProxy:
            proxy = await FaultProxy(target, **kwargs).start()
            proxies.append(proxy)
            return proxy

        try:
            yield start
        finally:
            for p in proxies:
                await p.close()

else:  # pragma: no cover

    @pytest.fixture
    def kvflow_pair() -> Iterator[None]:
        pytest.skip("kvflow_pair is an async fixture: install pytest-asyncio")
        yield None

    @pytest.fixture
    def fault_proxy() -> Iterator[None]:
        pytest.skip("fault_proxy is an async fixture: install pytest-asyncio")
        yield None
