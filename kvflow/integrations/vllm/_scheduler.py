"""The connector's scheduler side: which requests load from, or are kept for, a remote engine.

It moves no bytes and opens no socket. It reads and writes ``kv_transfer_params``:

- prefill (``do_remote_decode``): when the request finishes, keep its blocks and answer the
  parameters that the decode engine needs (``request_finished``);
- decode (``do_remote_prefill``): ask vLLM for blocks for the prompt, load it asynchronously, and
  tell the worker which remote blocks go where (``update_state_after_alloc``, ``build_connector_meta``).
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow import LLMParamInvalid

from ._settings import Push, Recv, Settings, StepMeta

log = logging.getLogger("kvflow.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
_REMOTE_FIELDS = ("remote_request_id", "remote_cluster_id", "remote_host", "remote_port", "remote_block_ids")


def check_tp(local_tp: int, params: dict[str, Any]) -> None:
    """LLMParamInvalid unless the remote engine has our tensor-parallel size (rank r pairs with rank r)."""
    remote = params.get("remote_tp_size", local_tp)
    if remote != local_tp:
        raise LLMParamInvalid(
            f"kvflow connector: the remote engine has tensor parallel size {remote} and this one {local_tp}; "
            "kvflow pairs rank r with rank r and does not split heads between different sizes: run prefill "
            "and decode with the same --tensor-parallel-size")


class SchedulerSide:
    def __init__(self, settings: Settings, engine_id: str, tp_size: int, block_size: int,
                 producer: bool, consumer: bool) -> None:
        self.s = settings
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self.kv_cache_manager: Any = None  # bound by vLLM; push mode reads a request's blocks from it
        self._meta = StepMeta()
        self._pushing: dict[str, int] = {}  # push mode, prefill: request -> blocks already scheduled for push
        self._prompt_len: dict[str, int] = {}
        self._keys: dict[str, str] = {}  # push mode, prefill: request -> the key the decode side's "want" names
        self._local_hits: dict[str, int] = {}  # decode: tokens found in the local prefix cache, per request
        self.refused = 0  # requests computed locally because the remote engine could not be paired

    # ------------------------------------------------------------------ decode side
    def _remote(self, params: dict[str, Any] | None, tp_checked: bool = False) -> bool:
        """Whether ``params`` ask for a load this side can make (the tensor-parallel check once per request)."""
        if not params or not params.get("do_remote_prefill"):
            return False
        missing = [f for f in _REMOTE_FIELDS if f not in params]
        if params.get("kvflow_mode", "pull") == "pull" and missing:
            log.warning("kvflow connector: kv_transfer_params lack %s; the request is computed locally", missing)
            return False
        if tp_checked:
            return True
        try:
            check_tp(self.tp_size, params)
        except LLMParamInvalid as exc:
            self.refused += 1
            log.error("%s; request computed locally", exc)
            return False
        return True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self._remote(params):
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        load_async = self.s.load == "async" or params.get("kvflow_mode", "pull") == "push"
        # a load inside the step leaves the prompt's last token to compute: a step needs one token to run
        count = len(request.prompt_token_ids or ()) - num_computed_tokens - (0 if load_async else 1)
        if count <= 0:
            return 0, False
        return count, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not self._remote({**params, "do_remote_prefill": True}, tp_checked=True):
            return  # with nothing loaded, the worker still tells the prefill engine to free its blocks
        hits = self._local_hits.pop(request.request_id, 0)  # tokens this engine had cached: whole blocks
        total = -(-len(request.prompt_token_ids or ()) // self.block_size)
        local = blocks.get_block_ids()[0][hits // self.block_size:total] if num_external_tokens > 0 else []
        self._meta.recv.append(self._recv(request, params, local))

    def _recv(self, request: Any, params: dict[str, Any], local: list[int]) -> Recv:
        mode = str(params.get("kvflow_mode", "pull"))
        total = -(-len(request.prompt_token_ids or ()) // self.block_size)
        first = total - len(local)
        remote = list(params.get("remote_block_ids") or [])
        if mode == "pull":
            remote = remote[first:first + len(local)] if len(remote) >= first + len(local) else []
            if len(remote) != len(local):
                log.warning("kvflow connector: %s: the remote engine sent %d blocks for %d; computed locally",
                            request.request_id, len(params.get("remote_block_ids") or ()), total)
                local = []
        remote_id = params.get("kvflow_transfer_id", params.get("remote_request_id"))
        return Recv(request.request_id, str(remote_id), int(params["remote_cluster_id"]),
                    str(params["remote_host"]), int(params["remote_port"]), remote, local, first, mode)

    # ------------------------------------------------------------------ prefill side
    def build_connector_meta(self, out: Any) -> StepMeta:
        if self.producer and self.s.mode == "push":
            self._schedule_pushes(out)
        meta, self._meta = self._meta, StepMeta()
        return meta

    def _schedule_pushes(self, out: Any) -> None:
        """Push mode: the blocks that this step's prompt tokens fill, for requests bound to a decode engine."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            done = self._pushing.get(req_id)
            if done is None or req_id not in computed:
                continue
            prompt = self._prompt_len[req_id]
            end_tok = min(computed[req_id] + n, prompt)
            end = -(-end_tok // self.block_size)
            if end > done:
                ids = self.kv_cache_manager.get_block_ids(req_id)[0]
                self._meta.push.append(Push(req_id, self._keys[req_id], list(ids[done:end]), done, end_tok >= prompt))
                self._pushing[req_id] = end

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if self.producer and self.s.mode == "push" and params and params.get("do_remote_decode") \
                and params.get("kvflow_mode") == "push":
            self._pushing[request.request_id] = 0
            self._prompt_len[request.request_id] = len(request.prompt_token_ids or ())
            self._keys[request.request_id] = str(params.get("kvflow_transfer_id", request.request_id))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._pushing.pop(request.request_id, None)
        self._prompt_len.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # decode side, aborted before its blocks were allocated
            params["do_remote_prefill"] = False
            if self._remote({**params, "do_remote_prefill": True}, tp_checked=True):
                self._meta.recv.append(self._recv(request, params, []))  # the worker tells the prefill to free
            return False, None
        if not params.get("do_remote_decode") or not self.producer:
            return False, None
        if request.status.name not in _FINISHED_OK or not block_ids:
            return False, None  # aborted or preempted away: nothing for a decode engine to load
        self._meta.send.append(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_cluster_id": self.s.cluster_id,
            "remote_host": self.s.host,
            "remote_port": self.s.port,
            "remote_block_ids": list(block_ids),
            "remote_tp_size": self.tp_size,
            "kvflow_mode": params.get("kvflow_mode", "pull"),
        }
