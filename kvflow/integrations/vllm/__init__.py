"""vLLM's KV connector on kvflow: ``--kv-transfer-config '{"kv_connector": "KvflowConnector",
"kv_connector_module_path": "kvflow.integrations.vllm", "kv_role": "kv_producer", ...}'``.

Pull-on-decode by default: the prefill engine keeps a finished request's blocks, the decode engine
pulls them with one kvflow call and then tells the prefill to free them. With ``"mode": "push"``
the prefill pushes each layer to the decode engine's blocks while the next layer computes.
docs/vllm.md has the options, the request life-cycle and what is not supported.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ._scheduler import SchedulerSide
from ._settings import Push, Recv, Settings, StepMeta
from ._worker import WorkerSide

__all__ = ["KvflowConnector", "KvflowConnectorMetadata"]

log = logging.getLogger("kvflow.vllm")


class KvflowConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the worker side for one step."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step

    @property
    def recv(self) -> list[Recv]:
        return self.step.recv

    @property
    def send(self) -> list[str]:
        return self.step.send

    @property
    def push(self) -> list[Push]:
        return self.step.push


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError, ImportError):  # no model parallel group: a single worker
        return 0


class KvflowConnector(KVConnectorBase_V1):
    """A ``KVConnectorBase_V1`` that moves vLLM's paged KV cache with kvflow."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self.settings = Settings.parse(kt.kv_connector_extra_config, str(kt.engine_id))
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        producer, consumer = bool(kt.is_kv_producer), bool(kt.is_kv_consumer)
        if producer and not self.settings.port:
            from kvflow import LLMParamInvalid
            raise LLMParamInvalid("kvflow connector: a kv_producer needs a 'port' in kv_connector_extra_config: "
                                  "decode engines dial host:port+rank")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.settings, str(kt.engine_id), self.tp_size,
                                        int(vllm_config.cache_config.block_size), producer, consumer)
        else:
            num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else \
                int(vllm_config.cache_config.num_gpu_blocks)
            self._worker = WorkerSide(self.settings, _tp_rank(), num_blocks, producer, consumer)

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side method was called on the scheduler's connector"
        return self._worker

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side method was called on a worker's connector"
        return self._sched

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # layer-wise loads and saves run Python between layers, which a captured graph would skip
        return (extra_config or {}).get("mode") == "push" or (extra_config or {}).get("load") == "layer"

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvflowConnectorMetadata)
        self.worker.start_load(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.worker.end_step()  # pushes continue in the background; blocks stay held until they end

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recved, failed = self.worker.finished()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recved, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvflowConnectorMetadata:
        return KvflowConnectorMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

