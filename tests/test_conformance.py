"""Every installed transport that can run here passes ``kvflow.testing.check_transport``."""

from __future__ import annotations

import pytest

from kvflow import available_transports
from kvflow.testing import check_transport

AVAILABLE = available_transports()


def _needs(name: str) -> pytest.MarkDecorator:
    state = AVAILABLE.get(name, "not installed")
    return pytest.mark.skipif(state != "ok", reason=f"{name}: {state}")


@pytest.mark.asyncio
@_needs("tcp")
async def test_tcp() -> None:
    await check_transport("tcp", timeout=120)


@pytest.mark.asyncio
@_needs("shm")
async def test_shm() -> None:
    await check_transport("shm", timeout=120)


@pytest.mark.asyncio
@_needs("shm")
async def test_shm_every_copy_in_a_thread() -> None:
    # InlineBytes=0 sends every batch through the worker threads (and their cancellation path)
    await check_transport("shm", options={"kvflow.shm.InlineBytes": "0", "kvflow.shm.Threads": "1"},
                          timeout=120)
