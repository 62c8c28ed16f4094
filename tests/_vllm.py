"""Drive vLLM's real Scheduler and KvflowConnector's worker side as vLLM's engine and model runner do.

Each engine (prefill, decode) is a real ``vllm.v1.core.sched.scheduler.Scheduler`` with its
scheduler-side connector, built on CPU from a local tiny-Llama ``config.json`` (no weights, no
download), and a worker process that holds the KV cache tensors in vLLM's layout and a
worker-side ``KvflowConnector``. What replaces the model: the prefill worker writes each scheduled
block, layer by layer, with bytes that depend only on (request, layer, block index in the request),
and calls ``save_kv_layer`` after each layer, as vLLM's attention layers do. So the decode side can
check every byte it received.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

NUM_LAYERS = 3
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_SIZE = 16
NUM_BLOCKS = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
EOS = 2


def model_dir(root: Path) -> str:
    """A tiny Llama's config.json: enough for vLLM's ModelConfig; no tokenizer, no weights."""
    d = root / "tiny-llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * HEAD_SIZE * 2,
        "intermediate_size": 128, "num_attention_heads": KV_HEADS * 2, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS}))
    return str(d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_config(model: str, role: str, extra: dict[str, Any], *, policy: str = "recompute") -> Any:
    """The engine's config; its engine id is the role, so that its scheduler and worker agree on it."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=1024)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="KvflowConnector", kv_connector_module_path="kvflow.integrations.vllm",
                          kv_role=role, engine_id=f"{role}-engine", kv_connector_extra_config=extra,
                          kv_load_failure_policy=policy)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def make_scheduler(vc: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config(), log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK_SIZE)


def make_request(req_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 1) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = params
    return req


# ---------------------------------------------------------------------- the bytes a "model" writes
def pattern(key: str, layer: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """What the fake forward writes into block ``index`` of request ``key`` at ``layer`` (K and V)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{layer}/{index}".encode()))
    return torch.rand(shape, generator=g)


def layer_tensor(layout: str) -> torch.Tensor:
    """One layer's KV cache in the layout of a vLLM attention backend."""
    if layout == "kv-first":  # FlashAttention: (2, num_blocks, block_size, heads, head_size)
        return torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    if layout == "blocks-first":  # FlashInfer: (num_blocks, 2, block_size, heads, head_size)
        return torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    if layout == "hnd":  # kv-first, heads before tokens in memory (a permuted view, as vLLM's HND layout)
        return torch.zeros(2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE).permute(0, 1, 3, 2, 4)
    raise ValueError(layout)


def block_view(t: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block`` of a layer tensor, as (2, block_size, heads, head_size)."""
    return t[:, block] if t.shape[0] == 2 else t[block]


BLOCK_SHAPE = (2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)


# ---------------------------------------------------------------------- the worker process
def _worker_main(conn: Connection, model: str, role: str, extra: dict[str, Any], layout: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvflow.integrations.vllm import KvflowConnector, KvflowConnectorMetadata

    logging.basicConfig(level=logging.WARNING, format=f"[{role} worker] %(name)s %(levelname)s %(message)s", force=True)
    vc = vllm_config(model, role, extra)
    conn_ = KvflowConnector(vc, KVConnectorRole.WORKER, kv_cache_config())
    caches = {name: layer_tensor(layout) for name in LAYERS}
    conn_.register_kv_caches(caches)
    conn.send(("ready", conn_.worker.listen_address))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            conn_.shutdown()
            conn.send(("ok", None))
            return
        try:
            if msg[0] == "step":  # one forward pass, as vLLM's model runner drives the connector
                _, step, fills = msg
                conn_.bind_connector_metadata(KvflowConnectorMetadata(step))
                conn_.start_load_kv(None)
                for layer, name in enumerate(LAYERS):
                    conn_.wait_for_layer_load(name)
                    for key, blocks in fills:  # this layer's "compute": the request's blocks get its bytes
                        for index, block in blocks:
                            block_view(caches[name], block).copy_(pattern(key, layer, index, BLOCK_SHAPE))
                    conn_.save_kv_layer(name, caches[name], None)
                conn_.wait_for_save()
                r = conn_.get_transfer_results(set())
                errors = conn_.get_block_ids_with_load_errors()
                conn_.clear_connector_metadata()
                conn.send(("ok", (r.finished_sending, r.finished_recving, r.failed_recving, errors)))
            elif msg[0] == "read":  # the bytes of some blocks, every layer
                conn.send(("ok", [[block_view(caches[n], b).clone() for b in msg[1]] for n in LAYERS]))
            elif msg[0] == "expired":
                conn.send(("ok", conn_.worker.expired))
        except Exception as exc:  # reported to the test, which fails with it
            import traceback
            conn.send(("crash", f"{exc!r}\n{traceback.format_exc()}"))


@dataclass
class Worker:
    proc: Any
    conn: Connection
    address: tuple[str, int] | None

    def call(self, *msg: Any, timeout: float = 60.0) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {msg[0]!r} within {timeout} s")
        kind, value = self.conn.recv()
        assert kind == "ok", value
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except (AssertionError, TimeoutError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start_worker(model: str, role: str, extra: dict[str, Any], layout: str = "kv-first") -> Worker:
    """A worker process, forked from the test process (vLLM is already imported here)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(child, model, role, extra, layout), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(120):
        proc.kill()
        raise TimeoutError("worker did not start")
    kind, value = parent.recv()
    assert kind == "ready", value
    return Worker(proc, parent, tuple(value) if value else None)


# ---------------------------------------------------------------------- one engine: scheduler + worker
@dataclass
class Engine:
    sched: Any
    worker: Worker
    fill: bool  # the prefill engine's "forward" writes its requests' blocks
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # request -> kv_transfer_params returned
    finished: set[str] = field(default_factory=set)
    step_results: list[Any] = field(default_factory=list)

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        fills = []
        if self.fill:
            mgr = self.sched.kv_cache_manager
            for req_id in out.num_scheduled_tokens:
                ids = mgr.get_block_ids(req_id)[0]
                fills.append((req_id, list(enumerate(ids))))
        sent, recved, failed, errors = self.worker.call("step", out.kv_connector_metadata.step, fills)
        self.step_results.append((sent, recved, failed, errors))
        req_ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[7] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None,
                                kv_connector_output=KVConnectorOutput(finished_sending=sent or None,
                                                                      finished_recving=recved or None,
                                                                      invalid_block_ids=errors,
                                                                      failed_recving=failed))
        outputs = self.sched.update_from_output(out, mro)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.kv_transfer_params is not None:
                    self.params[o.request_id] = o.kv_transfer_params
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        return out

    def step_until(self, done: Any, steps: int = 400, pause: float = 0.01) -> None:
        """Step (bounded in count) until ``done()``; a pause between steps lets transfers run."""
        import time
        for _ in range(steps):
            self.step()
            if done():
                return
            time.sleep(pause)
        raise AssertionError("the engine did not get there within the step bound")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
