"""Bulk-copy threads run under the scheduling policy that ``kvflow.WorkerPriority`` names."""

from __future__ import annotations

import os

import pytest

from kvflow import LlmDataDist, LLMParamInvalid, LlmRole
from kvflow._memory import Registry
from kvflow.transport import TransportContext

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _policy_in_pool(priority: str) -> int:
    pool = TransportContext(1, {}, Registry(), "x", priority).worker_pool("kvflow-test", 1)
    try:
        return pool.submit(os.sched_getscheduler, 0).result(timeout=10)
    finally:
        pool.shutdown()


def test_worker_threads_run_under_sched_idle_by_default() -> None:
    assert TransportContext(1, {}, Registry(), "x").worker_priority == "idle"
    assert _policy_in_pool("idle") == os.SCHED_IDLE


def test_worker_threads_keep_the_normal_policy_when_asked() -> None:
    assert _policy_in_pool("normal") == os.SCHED_OTHER


def test_the_callers_thread_is_left_alone() -> None:
    before = os.sched_getscheduler(0)
    _policy_in_pool("idle")
    assert os.sched_getscheduler(0) == before


@pytest.mark.asyncio
async def test_an_unknown_worker_priority_is_refused_with_the_key() -> None:
    dd = LlmDataDist(1, LlmRole.PROMPT)
    with pytest.raises(LLMParamInvalid, match=r"kvflow\.WorkerPriority"):
        await dd.initialize({"kvflow.WorkerPriority": "realtime"})
