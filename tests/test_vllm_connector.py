"""KvflowConnector in vLLM: its real Scheduler on CPU, worker sides in two processes, every byte checked.

The prefill and decode engines are vLLM's own ``Scheduler`` objects with the connector's scheduler
side (loaded by vLLM from ``kv_connector_module_path``), in this process; each engine's worker side
runs in a process of its own with its KV cache tensors, driven as vLLM's model runner drives it
(tests/_vllm.py). The model's forward pass is the one stand-in: no model runs on these machines'
CPUs within a test's time, so the prefill's "forward" writes known bytes into each block it computes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from kvflow import DataType, LLMParamInvalid, Placement
from kvflow.integrations.vllm._layout import describe
from kvflow.integrations.vllm._scheduler import check_tp
from kvflow.integrations.vllm._settings import Settings

from . import _vllm as v

TRANSPORTS = ["tcp", "shm"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return v.model_dir(tmp_path_factory.mktemp("vllm"))


def _extra(transport: str, port: int = 0, **more: Any) -> dict[str, Any]:
    return {"port": port, "transport": transport, "options": {"kvflow.HeartbeatTimeout": "3000"}, **more}


class Pair:
    """A prefill engine and a decode engine, linked by kvflow through the connector."""

    def __init__(self, model: str, transport: str, *, mode: str = "pull", load: str = "async",
                 layout: str = "kv-first", p_extra: dict[str, Any] | None = None) -> None:
        port = v.free_port()
        p_cfg = _extra(transport, port, mode=mode, **(p_extra or {}))
        d_cfg = _extra(transport, mode=mode, load=load)
        self.model, self.p_cfg = model, p_cfg
        self.p_worker = v.start_worker(model, "kv_producer", p_cfg, layout)
        self.d_worker = v.start_worker(model, "kv_consumer", d_cfg, layout)
        self.p = v.Engine(v.make_scheduler(v.vllm_config(model, "kv_producer", p_cfg)), self.p_worker, fill=True)
        self.d = v.Engine(v.make_scheduler(v.vllm_config(model, "kv_consumer", d_cfg)), self.d_worker, fill=False)

    def close(self) -> None:
        self.p_worker.stop()
        self.d_worker.stop()

    def prefill(self, req_id: str, prompt: list[int], extra_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run ``req_id`` on the prefill engine (max_tokens=1, as a proxy sends it) and return the
        kv_transfer_params its output carries for the decode engine."""
        self.p.sched.add_request(v.make_request(req_id, prompt, {"do_remote_decode": True, **(extra_params or {})}))
        self.p.step_until(lambda: req_id in self.p.finished)
        return self.p.params[req_id]

    def decode_loads(self, req_id: str, params: dict[str, Any], prompt: list[int]) -> Any:
        """Add the request to the decode engine and step until its KV arrived; the request."""
        self.d.sched.add_request(v.make_request(req_id, prompt, dict(params), max_tokens=4))
        self.d.step_until(lambda: any(req_id in r[1] for r in self.d.step_results))
        return self.d.sched.requests[req_id]


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest, model: str) -> Iterator[Pair]:
    p = Pair(model, request.param)
    yield p
    p.close()


def _expect(key: str, nblocks: int) -> list[list[torch.Tensor]]:
    return [[v.pattern(key, layer, i, v.BLOCK_SHAPE) for i in range(nblocks)] for layer in range(v.NUM_LAYERS)]


def _check_bytes(worker: v.Worker, blocks: list[int], key: str) -> None:
    got = worker.call("read", blocks)
    want = _expect(key, len(blocks))
    for layer in range(v.NUM_LAYERS):
        for i in range(len(blocks)):
            assert torch.equal(got[layer][i], want[layer][i]), (layer, i)


# ---------------------------------------------------------------------- pull-on-decode
def test_pull_on_decode_moves_every_byte_and_frees_the_prefill_blocks(pair: Pair) -> None:
    prompt = list(range(1, 1 + 3 * v.BLOCK_SIZE + 5))  # 4 blocks, the last one partial
    params = pair.prefill("p-1", prompt)
    assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 4
    free_before = pair.p.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    req = pair.decode_loads("d-1", params, prompt)
    d_blocks = pair.d.sched.kv_cache_manager.get_block_ids("d-1")[0][:4]
    _check_bytes(pair.d_worker, d_blocks, "p-1")
    _check_bytes(pair.d_worker, d_blocks, "p-1")
    assert not any(r[2] or r[3] for r in pair.d.step_results)  # no failed loads

    # the decode engine runs the request from the loaded prefix (recomputing only the last token)
    pair.d.step_until(lambda: "d-1" in pair.d.finished)
    assert req.num_computed_tokens >= len(prompt)
    # the prefill engine frees its blocks once the decode side said it has them
    pair.p.step_until(lambda: any("p-1" in r[0] for r in pair.p.step_results))
    assert pair.p.sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    assert "p-1" not in pair.p.sched.requests
    assert pair.p_worker.call("expired") == 0


@pytest.mark.parametrize("layout", ["blocks-first", "hnd"])
def test_pull_on_decode_in_other_backend_layouts(model: str, layout: str) -> None:
    pair = Pair(model, "tcp", layout=layout)
    try:
        prompt = list(range(1, 2 * v.BLOCK_SIZE + 1))
        params = pair.prefill("p-l", prompt)
        pair.decode_loads("d-l", params, prompt)
        _check_bytes(pair.d_worker, pair.d.sched.kv_cache_manager.get_block_ids("d-l")[0][:2], "p-l")
        assert not any(r[2] or r[3] for r in pair.d.step_results)
    finally:
        pair.close()


def test_layer_by_layer_load_inside_the_step(model: str) -> None:
    """load="layer": the request is loaded within the decode step, each layer awaited when the model
    reaches it (wait_for_layer_load), not between steps."""
    pair = Pair(model, "tcp", load="layer")
    try:
        prompt = list(range(1, 2 * v.BLOCK_SIZE + 3))
        params = pair.prefill("p-y", prompt)
        pair.d.sched.add_request(v.make_request("d-y", prompt, dict(params), max_tokens=2))
        out = pair.d.step()
        assert out.num_scheduled_tokens.get("d-y") == 1  # scheduled at once: only the last token is computed
        _check_bytes(pair.d_worker, pair.d.sched.kv_cache_manager.get_block_ids("d-y")[0][:3], "p-y")
        assert not any(r[3] for r in pair.d.step_results)
    finally:
        pair.close()


# ---------------------------------------------------------------------- layer-wise push
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layer_wise_push_moves_every_byte(model: str, transport: str) -> None:
    """mode="push": the decode engine allocates first and says where; the prefill pushes each layer
    as its compute ends (save_kv_layer), then tells the decode engine that the request arrived."""
    pair = Pair(model, transport, mode="push")
    try:
        prompt = list(range(1, 3 * v.BLOCK_SIZE + 2))
        p_addr = {"kvflow_transfer_id": "t-1", "remote_cluster_id": pair.p.sched.connector.settings.cluster_id,
                  "remote_host": "127.0.0.1", "remote_port": pair.p.sched.connector.settings.port,
                  "remote_request_id": "", "remote_block_ids": [], "kvflow_mode": "push"}
        pair.d.sched.add_request(v.make_request("d-w", prompt, {"do_remote_prefill": True, **p_addr}, max_tokens=2))
        pair.d.step()  # allocates, and its worker sends "want" to the prefill rank
        deadline = time.monotonic() + 10
        pair.p.sched.add_request(v.make_request("p-w", prompt, {"do_remote_decode": True, "kvflow_mode": "push",
                                                                "kvflow_transfer_id": "t-1"}))
        while not any("d-w" in r[1] for r in pair.d.step_results) and time.monotonic() < deadline:
            pair.p.step()
            pair.d.step()
            time.sleep(0.01)
        d_blocks = pair.d.sched.kv_cache_manager.get_block_ids("d-w")[0][:4]
        _check_bytes(pair.d_worker, d_blocks, "p-w")
        assert not any(r[2] or r[3] for r in pair.d.step_results)
        pair.p.step_until(lambda: "p-w" not in pair.p.sched.requests)  # its blocks are free once pushed
    finally:
        pair.close()


# ---------------------------------------------------------------------- the life-cycle's other paths
def test_decode_abort_before_allocation_frees_the_prefill_blocks(model: str) -> None:
    pair = Pair(model, "tcp")
    try:
        prompt = list(range(1, v.BLOCK_SIZE + 4))
        params = pair.prefill("p-a", prompt)
        pair.d.sched.add_request(v.make_request("d-a", prompt, dict(params)))
        from vllm.v1.request import RequestStatus
        pair.d.sched.finish_requests("d-a", RequestStatus.FINISHED_ABORTED)  # before any step scheduled it
        pair.d.step()  # its worker tells the prefill to free
        pair.p.step_until(lambda: "p-a" not in pair.p.sched.requests)
        assert pair.p_worker.call("expired") == 0
    finally:
        pair.close()


def test_aborted_prefill_keeps_nothing_for_the_decode_side(model: str) -> None:
    pair = Pair(model, "tcp")
    try:
        from vllm.v1.request import RequestStatus
        pair.p.sched.add_request(v.make_request("p-x", list(range(1, 40)), {"do_remote_decode": True}))
        pair.p.sched.finish_requests("p-x", RequestStatus.FINISHED_ABORTED)
        pair.p.step()
        assert "p-x" not in pair.p.sched.requests and "p-x" not in pair.p.params
    finally:
        pair.close()


def test_preempted_decode_request_is_recomputed_locally_without_a_second_load(model: str) -> None:
    pair = Pair(model, "tcp")
    try:
        prompt = list(range(1, 2 * v.BLOCK_SIZE + 1))
        params = pair.prefill("p-r", prompt)
        req = pair.decode_loads("d-r", params, prompt)
        pair.d.step()  # running now
        pair.d.sched.running.remove(req)
        pair.d.sched._preempt_request(req, time.monotonic())
        loads = sum(len(r[1]) for r in pair.d.step_results)
        pair.d.step_until(lambda: "d-r" in pair.d.finished)
        assert sum(len(r[1]) for r in pair.d.step_results) == loads  # no second transfer
    finally:
        pair.close()


def test_unreachable_prefill_fails_the_load_into_recompute(model: str) -> None:
    """A remote engine that never answers: the decode engine recomputes the request."""
    pair = Pair(model, "tcp")
    try:
        prompt = list(range(1, 2 * v.BLOCK_SIZE + 1))
        params = pair.prefill("p-u", prompt)
        params = {**params, "remote_port": v.free_port()}  # nothing listens there
        req = pair.decode_loads("d-u", params, prompt)
        assert any("d-u" in r[2] for r in pair.d.step_results)  # reported as a failed receive
        pair.d.step()
        assert req.num_computed_tokens >= len(prompt) - 1  # recomputed locally, prompt and all
        pair.d.step_until(lambda: "d-u" in pair.d.finished)
    finally:
        pair.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_prefill_that_dies_fails_the_load_within_the_heartbeat_bound(model: str, how: str) -> None:
    pair = Pair(model, "tcp")
    try:
        prompt = list(range(1, 2 * v.BLOCK_SIZE + 1))
        first = pair.prefill("p-1", prompt)
        pair.decode_loads("d-1", first, prompt)  # linked now
        params = pair.prefill("p-2", prompt)
        pid = pair.p_worker.proc.pid
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        try:
            start = time.monotonic()
            pair.decode_loads("d-2", params, prompt)
            took = time.monotonic() - start
            assert any("d-2" in r[2] for r in pair.d.step_results)
            assert took < 3.0 + 5.0, took  # HeartbeatTimeout (3 s) plus slack for a loaded machine
        finally:
            if how == "stopped":
                os.kill(pid, signal.SIGCONT)
        if how == "killed":  # a prefill restarted at the same address: the decode side links again
            pair.p_worker.proc.join(5)
            pair.p_worker = pair.p.worker = v.start_worker(pair.model, "kv_producer", pair.p_cfg)
            fresh = list(range(500, 500 + 2 * v.BLOCK_SIZE))  # a prompt the decode engine has not cached
            params = pair.prefill("p-3", fresh)
            pair.decode_loads("d-3", params, fresh)
            assert not any("d-3" in r[2] for r in pair.d.step_results)
            _check_bytes(pair.d_worker, pair.d.sched.kv_cache_manager.get_block_ids("d-3")[0][:2], "p-3")
    finally:
        pair.close()


def test_prefill_frees_blocks_the_decode_side_never_takes(model: str) -> None:
    pair = Pair(model, "tcp", p_extra={"release_timeout_s": 0.5})
    try:
        pair.prefill("p-t", list(range(1, 40)))
        assert "p-t" in pair.p.sched.requests  # held for the decode side
        pair.p.step_until(lambda: "p-t" not in pair.p.sched.requests, pause=0.05)
        assert pair.p_worker.call("expired") == 1
    finally:
        pair.close()


def test_different_tensor_parallel_sizes_are_refused_and_computed_locally(model: str) -> None:
    with pytest.raises(LLMParamInvalid, match="tensor parallel size 2 and this one 1"):
        check_tp(1, {"remote_tp_size": 2})
    pair = Pair(model, "tcp")
    try:
        prompt = list(range(1, 40))
        params = {**pair.prefill("p-tp", prompt), "remote_tp_size": 2}
        pair.d.sched.add_request(v.make_request("d-tp", prompt, params))
        out = pair.d.step()
        assert out.num_scheduled_tokens.get("d-tp") == len(prompt)  # the whole prompt, computed here
        assert pair.d.sched.connector.scheduler.refused == 1
    finally:
        pair.close()


# ---------------------------------------------------------------------- registration and settings
def test_layouts_are_split_into_blocks_of_dense_bytes() -> None:
    """Each kvflow tensor's block b holds exactly the memory of vLLM's block b (K or V, or both)."""
    for layout, per_layer in (("kv-first", 2), ("blocks-first", 1), ("hnd", 2)):
        t = v.layer_tensor(layout)
        t.copy_(torch.rand(t.shape))
        lay = describe({n: t for n in v.LAYERS}, v.NUM_BLOCKS)
        assert lay.per_layer == per_layer and lay.desc.num_tensors == per_layer * v.NUM_LAYERS
        assert lay.desc.data_type == DataType.DT_FLOAT and lay.desc.placement == Placement.HOST
        memory = t.permute(0, 1, 3, 2, 4) if layout == "hnd" else t  # the layer in the order of its bytes
        assert memory.is_contiguous()
        for b in (0, 5, v.NUM_BLOCKS - 1):
            want = [memory[b].flatten()] if per_layer == 1 else [memory[k, b].flatten() for k in range(2)]
            for k in range(per_layer):
                assert torch.equal(lay.tensors[k][b].view(torch.float32), want[k]), (layout, b, k)


def test_layouts_that_cannot_be_addressed_are_refused() -> None:
    padded = torch.zeros(2, v.NUM_BLOCKS, v.BLOCK_SIZE + 1, 8)[:, :, : v.BLOCK_SIZE]  # padding after each block
    with pytest.raises(LLMParamInvalid, match="dense slab"):
        describe({"l": padded}, v.NUM_BLOCKS)
    with pytest.raises(LLMParamInvalid, match="one layout for every layer"):
        describe({"a": torch.zeros(2, v.NUM_BLOCKS, 16), "b": torch.zeros(v.NUM_BLOCKS, 2, 16)}, v.NUM_BLOCKS)
    with pytest.raises(LLMParamInvalid, match="no KV cache"):
        describe({}, v.NUM_BLOCKS)


def test_settings_are_checked() -> None:
    with pytest.raises(LLMParamInvalid, match="unknown"):
        Settings.parse({"prot": 1}, "e")
    with pytest.raises(LLMParamInvalid, match="mode"):
        Settings.parse({"mode": "teleport"}, "e")
    assert Settings.parse({}, "e1").cluster_id != Settings.parse({}, "e2").cluster_id
