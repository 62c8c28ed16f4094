"""kvflow.compat.llm_datadist: the public llm_datadist samples, ported to CPU numpy arrays.

Each sample of hicann/hixl ``examples/python/llm_datadist`` (push_blocks, push_cache, pull_blocks with
several prefill instances, transfer_cache_async, switch_role) runs as it is written there, with its
call sequence, role by role: one role in this process, the others in ``spawn`` children, all through
``import kvflow.compat.llm_datadist as llm_datadist``. What differs: memory is numpy arrays (addresses
from ``arr.ctypes.data``, still registered as ``Placement.DEVICE``), listen ports are picked by the
system (port 0) and handed over in shared memory, ``dist.barrier()`` is a multiprocessing barrier, and
the sample's ``logging.info(tensor)`` becomes a check of every byte. Each runs over tcp and shm.
The end of the module checks the surface: types, options, errors, placement, keys.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import kvflow
import kvflow.compat.llm_datadist as llm_datadist
import kvflow.sync
from kvflow.compat._placement import resolve_placement
from kvflow.compat.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

from ._docblocks import python_blocks, run_as_script

CTX = mp.get_context("spawn")
LOCAL_IP = "127.0.0.1"
ROLE_TIMEOUT_S = 60.0
TRANSPORTS = [pytest.param(t, id=t, marks=() if kvflow.available_transports().get(t) == "ok"
                           else pytest.mark.skip(reason=f"{t}: {kvflow.available_transports().get(t)}"))
              for t in ("tcp", "shm")]

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0  # the samples' ids: 0 is a valid cluster id
DECODER_CLUSTER_ID = 1


# ---------------------------------------------------------------------- the harness
@dataclass
class Board:
    """What the roles of one sample share: the barrier (the samples' ``dist.barrier()``) and the
    listen ports (the samples' fixed 26000/26001, here picked by the system)."""

    barrier: Any
    ports: Any
    transport: str

    def wait(self) -> None:
        self.barrier.wait(ROLE_TIMEOUT_S)

    def publish(self, slot: int, datadist: LLMDataDist) -> None:
        address = datadist.listen_address
        assert address is not None
        self.ports[slot] = address[1]

    def port(self, slot: int) -> int:
        port = int(self.ports[slot])
        assert port, f"nothing published in slot {slot}"
        return port


Role = Callable[..., Any]


def _role_main(role: Role, board: Board, args: tuple[Any, ...], results: Any, name: str) -> None:
    """A child: run one role; its return value (or its traceback) goes back to the test."""
    try:
        results.put((name, "ok", role(board, *args)))
    except BaseException:
        board.barrier.abort()  # the other roles stop waiting for this one
        results.put((name, "err", traceback.format_exc()))


def run_roles(transport: str, here: tuple[Role, tuple[Any, ...]],
              children: dict[str, tuple[Role, tuple[Any, ...]]]) -> dict[str, Any]:
    """Run ``here`` in this process and each of ``children`` in a spawn child; every role's result
    by name ("here" for this process's); any role's failure fails the test with its traceback."""
    board = Board(CTX.Barrier(1 + len(children)), CTX.Array("i", 8), transport)
    results = CTX.Queue()
    procs = [CTX.Process(target=_role_main, args=(fn, board, args, results, name), daemon=True)
             for name, (fn, args) in children.items()]
    for p in procs:
        p.start()
    out: dict[str, Any] = {}
    failures: list[str] = []
    try:
        try:
            out["here"] = here[0](board, *here[1])
        except BaseException:
            board.barrier.abort()
            failures.append(f"here:\n{traceback.format_exc()}")
        for _ in procs:
            try:
                name, kind, value = results.get(timeout=ROLE_TIMEOUT_S)
            except queue.Empty:
                failures.append("a child role sent nothing")
                break
            if kind == "ok":
                out[name] = value
            else:
                failures.append(f"{name}:\n{value}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not failures, "\n".join(failures)
    return out


def init_llm_datadist(board: Board, role: LLMRole, cluster_id: int, *, listen: bool = True,
                      **config: Any) -> LLMDataDist:
    """The samples' ``init_llm_datadist``: LLMConfig -> generate_options -> init, plus the transport
    under test and a heartbeat tolerant of a loaded CI machine (kvflow options pass through)."""
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    for name, value in config.items():
        setattr(llm_config, name, value)
    if listen:
        llm_config.listen_ip_info = f"{LOCAL_IP}:0"
    llm_options = llm_config.generate_options()
    llm_options.update({"kvflow.Transports": board.transport, "kvflow.HeartbeatTimeout": "10000",
                        "llm.SyncKvCacheWaitTime": "10000"})
    datadist.init(llm_options)
    return datadist


def tensor(seed: int, shape: tuple[int, ...] = (BLOCKS_NUM, KV_SHAPE)) -> np.ndarray:
    """float32 values that differ in every element and between seeds."""
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000.0 * seed + 1.0)


def blocks_desc(num_tensors: int = NUM_TENSORS) -> CacheDesc:
    return CacheDesc(num_tensors=num_tensors, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)


def link(board: Board, datadist: LLMDataDist, remote_cluster_id: int, port: int) -> None:
    """The samples' link step; the link must use the transport under test."""
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    cluster.append_local_ip_info(LOCAL_IP, 0)
    cluster.append_remote_ip_info(LOCAL_IP, port)
    ret, rets = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"link failed: {ret} {rets}")
    assert datadist.kvflow.link_info(remote_cluster_id).transport == board.transport


def unlink(datadist: LLMDataDist, remote_cluster_id: int, force: bool, port: int | None = None) -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    if port is not None:
        cluster.append_remote_ip_info(LOCAL_IP, port)
    ret, rets = datadist.unlink_clusters([cluster], 5000, force=force)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"unlink failed: {ret} {rets}")


# ---------------------------------------------------------------------- push_blocks_sample.py
def push_blocks_prompt(board: Board) -> list[np.ndarray]:
    datadist = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, local_comm_res="")
    board.publish(0, datadist)
    cache_manager = datadist.cache_manager
    tensors = [tensor(1), tensor(2)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    board.wait()  # register end
    board.wait()  # decoder push blocks end
    after = [t.copy() for t in tensors]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return after


def push_blocks_decoder(board: Board) -> None:
    datadist = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = [tensor(-1), tensor(-2)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    board.wait()  # register end
    link(board, datadist, PROMPT_CLUSTER_ID, board.port(0))
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    board.wait()  # push_blocks end
    unlink(datadist, PROMPT_CLUSTER_ID, force=True)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_blocks_sample(transport: str) -> None:
    out = run_roles(transport, (push_blocks_decoder, ()), {"prompt": (push_blocks_prompt, ())})
    for t, got in enumerate(out["prompt"]):
        want = tensor(t + 1)
        want[[0, 2]] = tensor(-(t + 1))[[0, 1]]
        assert np.array_equal(got, want), f"prompt tensor {t}:\n{got}"


# ---------------------------------------------------------------------- push_cache_sample.py
def push_cache_prompt(board: Board) -> list[np.ndarray]:
    datadist = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, local_comm_res="")
    board.publish(0, datadist)
    cache_manager = datadist.cache_manager
    tensors = [tensor(1), tensor(2)]
    cache = cache_manager.register_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors])
    assert cache.cache_id == 1 and not cache.is_blocks_cache  # the decoder names it by this id
    board.wait()  # register end
    board.wait()  # decoder push cache end
    after = [t.copy() for t in tensors]
    board.wait()  # wait unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return after


def push_cache_decoder(board: Board) -> None:
    datadist = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = [tensor(-1), tensor(-2)]
    cache = cache_manager.register_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors])
    board.wait()  # register end
    link(board, datadist, PROMPT_CLUSTER_ID, board.port(0))
    cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0),
                             cache, src_batch_index=0)
    board.wait()  # push cache end
    unlink(datadist, PROMPT_CLUSTER_ID, force=False, port=board.port(0))
    board.wait()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_cache_sample(transport: str) -> None:
    out = run_roles(transport, (push_cache_decoder, ()), {"prompt": (push_cache_prompt, ())})
    for t, got in enumerate(out["prompt"]):
        want = tensor(t + 1)
        want[0] = tensor(-(t + 1))[0]
        assert np.array_equal(got, want), f"prompt tensor {t}:\n{got}"


# ---------------------------------------------------------------------- pull_blocks_xpyd_sample.py
def ip_port_to_int(ip_port: str) -> int:
    """The sample's cluster ids: IPv4 address and port packed into 48 bits."""
    ip, port = ip_port.split(":")
    return (struct.unpack("!I", socket.inet_aton(ip))[0] << 16) | int(port)


# The sample names each instance by its ip:port; the ports here are only names (listening is on port 0).
XPYD_PROMPTS = ["127.0.0.1:26000", "127.0.0.2:26000", "127.0.0.3:26001"]
XPYD_DECODER = "127.0.0.4:26000"


def xpyd_prompt(board: Board, index: int) -> None:
    local = ip_port_to_int(XPYD_PROMPTS[index])
    datadist = init_llm_datadist(board, LLMRole.PROMPT, local, local_comm_res="")
    board.publish(index, datadist)
    cache_manager = datadist.cache_manager
    arr = tensor(10 + index)
    desc = CacheDesc(num_tensors=1, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    cache = cache_manager.register_blocks_cache(desc, [int(arr.ctypes.data)], BlocksCacheKey(local, 0))
    board.wait()  # registered and listening (the sample sleeps)
    board.wait()  # the decoder pulled and unlinked (the sample sleeps 30 s)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def xpyd_decoder(board: Board) -> list[np.ndarray]:
    local = ip_port_to_int(XPYD_DECODER)
    datadist = init_llm_datadist(board, LLMRole.DECODER, local, listen=False, local_comm_res="")
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=1, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    arr = np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32)
    cache = cache_manager.register_blocks_cache(desc, [int(arr.ctypes.data)], BlocksCacheKey(local, 0))
    board.wait()  # register end
    cluster_list = []
    for i, remote in enumerate(XPYD_PROMPTS):
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = ip_port_to_int(remote)
        cluster.append_local_ip_info(LOCAL_IP, 0)
        cluster.append_remote_ip_info(LOCAL_IP, board.port(i))
        cluster_list.append(cluster)
    ret, rets = datadist.link_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"link failed: {rets}")
    assert {datadist.kvflow.link_info(c.remote_cluster_id).transport for c in cluster_list} == {board.transport}
    seen = []
    for remote in XPYD_PROMPTS:
        cache_manager.pull_blocks(BlocksCacheKey(ip_port_to_int(remote), 0), cache, src_blocks=[0, 1],
                                  dst_blocks=[0, 2])
        seen.append(arr.copy())
    ret, _ = datadist.unlink_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    board.wait()
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_blocks_from_several_prefill_instances(transport: str) -> None:
    prompts = {f"prompt{i}": (xpyd_prompt, (i,)) for i in range(len(XPYD_PROMPTS))}
    out = run_roles(transport, (xpyd_decoder, ()), prompts)
    for i, got in enumerate(out["here"]):
        want = np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32)
        want[[0, 2]] = tensor(10 + i)[[0, 1]]
        assert np.array_equal(got, want), f"after the pull from prefill {i}:\n{got}"


# ---------------------------------------------------------------------- transfer_cache_async_sample.py
class LayerSynchronizerImpl(LayerSynchronizer):
    def __init__(self, ret: bool = True) -> None:
        self._ret = ret

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self._ret


def transfer_prompt(board: Board) -> list[Any]:
    datadist = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, enable_cache_manager=True,
                                 enable_remote_cache_accessible=True)
    cache_manager = datadist.cache_manager
    tensors = [tensor(1), tensor(2)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    board.wait()  # register end
    link(board, datadist, DECODER_CLUSTER_ID, board.port(1))
    transfer_config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, 1), range(0, 1))
    cache_task = cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(True), [transfer_config])
    results = cache_task.get_results()
    code = cache_task.synchronize()
    board.wait()  # transfer cache end
    unlink(datadist, DECODER_CLUSTER_ID, force=True)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return [results, code]


def transfer_decoder(board: Board) -> list[np.ndarray]:
    datadist = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, enable_cache_manager=True,
                                 enable_remote_cache_accessible=True)
    board.publish(1, datadist)
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32) for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    board.wait()  # register end
    board.wait()  # prompt transfer cache end
    after = [t.copy() for t in tensors]
    unlink(datadist, PROMPT_CLUSTER_ID, force=True)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return after


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_cache_async_sample(transport: str) -> None:
    out = run_roles(transport, (transfer_prompt, ()), {"decoder": (transfer_decoder, ())})
    assert out["here"] == [[LLMStatusCode.LLM_SUCCESS], LLMStatusCode.LLM_SUCCESS]
    for t, got in enumerate(out["decoder"]):
        want = np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32)
        want[0] = tensor(t + 1)[0]  # no block indices: slot 0 (block 0) of the one layer
        assert np.array_equal(got, want), f"decoder tensor {t}:\n{got}"


LAYERS = 3


class ComputeEvents(LayerSynchronizer):
    """Blocks until the "forward pass" (the test's thread) has written a layer."""

    def __init__(self) -> None:
        self.done = [threading.Event() for _ in range(LAYERS)]
        self.asked: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        return self.done[layer_index].wait(30)


def layerwise_prompt(board: Board) -> list[Any]:
    """Layer by layer, blocks to two destinations of one peer: a blocks cache by key, and the same
    cache by id with other layers."""
    datadist = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, enable_cache_manager=True,
                                 enable_remote_cache_accessible=True)
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32) for _ in range(2 * LAYERS)]
    cache = cache_manager.register_blocks_cache(blocks_desc(2 * LAYERS), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 7))
    board.wait()
    link(board, datadist, DECODER_CLUSTER_ID, board.port(1))
    sync = ComputeEvents()
    configs = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 3), range(0, 3), range(0, 3)),
               TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, 2), range(1, 2), range(2, 3)),
               TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, 99), range(0, 1), range(0, 1))]
    task = cache_manager.transfer_cache_async(cache, sync, configs, src_block_indices=[0, 1],
                                              dst_block_indices=[2, 0])
    assert task.get_results(timeout_in_millis=50) == [LLMStatusCode.LLM_TIMEOUT] * 3  # nothing computed yet
    for layer in range(LAYERS):
        for t in (2 * layer, 2 * layer + 1):
            tensors[t][:] = tensor(100 + t)
        sync.done[layer].set()
    code = task.synchronize()
    results = task.get_results()
    board.wait()
    unlink(datadist, DECODER_CLUSTER_ID, force=True)
    datadist.finalize()
    return [code, results, sorted(set(sync.asked))]


def layerwise_decoder(board: Board) -> list[list[np.ndarray]]:
    datadist = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, enable_cache_manager=True,
                                 enable_remote_cache_accessible=True)
    board.publish(1, datadist)
    cache_manager = datadist.cache_manager
    caches = []
    for model_id in (5, 3):  # ids 1 and 2; the key names the second one
        arrays = [tensor(-t - 10 * model_id) for t in range(2 * LAYERS)]
        cache_manager.register_blocks_cache(blocks_desc(2 * LAYERS), [int(a.ctypes.data) for a in arrays],
                                            BlocksCacheKey(DECODER_CLUSTER_ID, model_id))
        caches.append(arrays)
    board.wait()
    board.wait()
    after = [[a.copy() for a in arrays] for arrays in caches]
    unlink(datadist, PROMPT_CLUSTER_ID, force=True)
    datadist.finalize()
    return after


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_cache_async_layer_by_layer_to_several_destinations(transport: str) -> None:
    out = run_roles(transport, (layerwise_prompt, ()), {"decoder": (layerwise_decoder, ())})
    code, results, asked = out["here"]
    S = LLMStatusCode
    assert results == [S.LLM_SUCCESS, S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST]  # model_id 99 is not registered
    assert code == S.LLM_KV_CACHE_NOT_EXIST and asked == [0, 1, 2]
    first, second = out["decoder"]
    for t in range(2 * LAYERS):  # cache 1 (model 5) is untouched
        assert np.array_equal(first[t], tensor(-t - 50))
    for t in range(2 * LAYERS):
        want = tensor(-t - 30)
        layer = t // 2
        src = {0: 0, 1: 1, 2: 2}[layer]  # config 0: layers 0..2 -> 0..2
        want[[2, 0]] = tensor(100 + 2 * src + t % 2)[[0, 1]]
        if layer == 2:  # config 1 (by id): source layer 1 -> destination layer 2, later or earlier
            alt = tensor(-t - 30)
            alt[[2, 0]] = tensor(100 + 2 + t % 2)[[0, 1]]
            assert np.array_equal(second[t], want) or np.array_equal(second[t], alt), f"tensor {t}"
            continue
        assert np.array_equal(second[t], want), f"tensor {t}:\n{second[t]}"


# ---------------------------------------------------------------------- switch_role_sample.py
def switch_prompt(board: Board) -> list[Any]:
    datadist = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, local_comm_res="")
    board.publish(0, datadist)
    cache_manager = datadist.cache_manager
    tensors = [tensor(1), tensor(2)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(PROMPT_CLUSTER_ID, 0))
    board.wait()  # register end
    board.wait()  # decoder unlink
    datadist.switch_role(LLMRole.DECODER)
    stopped_listening = datadist.listen_address is None
    board.wait()  # prompt switch role end, close listen
    board.wait()  # decoder switch role end, listen
    link(board, datadist, DECODER_CLUSTER_ID, board.port(1))
    board.wait()  # prompt link end
    board.wait()  # decoder push blocks end
    after = [t.copy() for t in tensors]
    unlink(datadist, DECODER_CLUSTER_ID, force=True)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return [stopped_listening, after]


def switch_decoder(board: Board) -> list[Any]:
    datadist = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, listen=False, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = [tensor(-1), tensor(-2)]
    cache = cache_manager.register_blocks_cache(blocks_desc(), [int(t.ctypes.data) for t in tensors],
                                                BlocksCacheKey(DECODER_CLUSTER_ID, 0))
    board.wait()  # register end
    link(board, datadist, PROMPT_CLUSTER_ID, board.port(0))
    cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    pulled = [t.copy() for t in tensors]
    try:  # the role cannot change while a link exists
        datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{LOCAL_IP}:0"})
        refused = None
    except LLMException as exc:
        refused = exc.status_code
    unlink(datadist, PROMPT_CLUSTER_ID, force=False, port=board.port(0))
    board.wait()  # decoder unlink
    board.wait()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{LOCAL_IP}:0"
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    board.publish(1, datadist)
    board.wait()  # decoder switch role end, listen
    board.wait()  # prompt link end
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1, 2],
                              dst_blocks=[0, 1, 2], src_layer_range=range(0, 2), dst_layer_range=range(0, 2),
                              tensor_num_per_layer=1)
    board.wait()  # decoder push blocks end
    unlink(datadist, PROMPT_CLUSTER_ID, force=True)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return [refused, cache.cache_id, pulled]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_switch_role_sample(transport: str) -> None:
    out = run_roles(transport, (switch_decoder, ()), {"prompt": (switch_prompt, ())})
    refused, cache_id, pulled = out["here"]
    assert refused == LLMStatusCode.LLM_EXIST_LINK and cache_id == 1
    for t, got in enumerate(pulled):
        want = tensor(-(t + 1))
        want[[0, 2]] = tensor(t + 1)[[0, 1]]
        assert np.array_equal(got, want), f"decoder tensor {t} after the pull:\n{got}"
    stopped_listening, after = out["prompt"]
    assert stopped_listening
    for t, got in enumerate(after):
        assert np.array_equal(got, pulled[t]), f"prompt tensor {t} after the push:\n{got}"


# ---------------------------------------------------------------------- one process: the surface
@pytest.fixture
def pair() -> Iterator[tuple[LLMDataDist, LLMDataDist]]:
    """Two instances in this process (kvflow allows that), tcp, the prompt (cluster 0) listening."""
    board = Board(None, None, "tcp")
    prompt = init_llm_datadist(board, LLMRole.PROMPT, PROMPT_CLUSTER_ID, local_comm_res="")
    decoder = init_llm_datadist(board, LLMRole.DECODER, DECODER_CLUSTER_ID, listen=False, local_comm_res="")
    try:
        yield prompt, decoder
    finally:
        decoder.finalize()
        prompt.finalize()


def test_the_import_line_is_the_only_change() -> None:
    sys.modules["llm_datadist"] = llm_datadist
    try:
        import llm_datadist as imported  # type: ignore[import-not-found]
        from llm_datadist import LLMDataDist as Imported  # type: ignore[import-not-found]
    finally:
        del sys.modules["llm_datadist"]
    assert imported is llm_datadist and Imported is LLMDataDist
    for name in ("LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
                 "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
                 "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
                 "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo"):
        assert name in llm_datadist.__all__ and hasattr(llm_datadist, name), name
    assert not hasattr(llm_datadist, "KvCacheManager")  # V1: refused, and an AttributeError for hasattr
    with pytest.raises(LLMException) as info:
        llm_datadist.KvCacheManager  # noqa: B018
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_status_codes_and_exceptions_are_kvflows() -> None:
    assert LLMException is kvflow.LLMException
    for code in kvflow.LLMStatusCode:
        if code.name in LLMStatusCode.__members__:
            assert LLMStatusCode[code.name] == code
    # the original's Python enum leaves out four internal codes of its C header; kvflow has them
    missing = {c.name for c in kvflow.LLMStatusCode if int(c) not in {int(x) for x in LLMStatusCode}}
    assert missing == {"LLM_CACHE_INCOMPATIBLE", "LLM_CACHE_KEY_ALREADY_EXIST", "LLM_COPY_CACHE_FAILED",
                       "LLM_CACHE_ID_ALREADY_EXIST"}
    assert LLMStatusCode.LLM_SEQ_LENOVERLIMIT == kvflow.LLMStatusCode.LLM_SEQ_LEN_OVER_LIMIT
    assert LLMStatusCode.LLM_UNKNOWN_ERROR == -1 and LLMStatusCode.LLM_DEVICE_MEM_ERROR == 507053
    exc = LLMException("x", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert exc.status_code == kvflow.LLMStatusCode.LLM_TIMEOUT
    assert llm_datadist.Status(LLMStatusCode.LLM_SUCCESS).is_ok()


def test_cluster_info_ip_encoding() -> None:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_remote_ip_info("127.0.0.1", 26000)
    cluster.append_local_ip_info(16777343, 26001)  # the same address, as the original encodes it
    assert cluster.remote_ip_info_list == [(16777343, 26000)]
    assert cluster.local_ip_info_list == [(16777343, 26001)]
    assert cluster._kvflow().remote_ip_infos == [kvflow.IpInfo("127.0.0.1", 26000)]
    cluster.remote_cluster_id = (1 << 64) - 1
    with pytest.raises(ValueError):
        cluster.remote_cluster_id = 1 << 64
    with pytest.raises(RuntimeError, match="Can not parse ip str"):
        cluster.append_remote_ip_info("not an ip", 1)
    with pytest.raises(TypeError):
        cluster.append_remote_ip_info(1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cluster.append_remote_ip_info("127.0.0.1", 70000)


def test_config_generates_options_kvflow_understands() -> None:
    config = LLMConfig()
    config.device_id = [3, 4]
    config.listen_ip_info = "127.0.0.1:26000"
    config.sync_kv_timeout = 20000
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.mem_pool_cfg = '{"memory_size": 1024}'
    config.local_comm_res = ""
    config.link_total_time = 5
    options = config.generate_options()
    assert options["llm.ListenIpInfo"] == "127.0.0.1:26000" and options["llm.SyncKvCacheWaitTime"] == "20000"
    assert options["llm.DeviceId"] == "3" and options["llm.EnableCacheManager"] == "1"
    settings = llm_datadist._settings(options)
    kvflow._options.parse_options(settings.kvflow_options)  # every key kvflow gets, it accepts
    assert settings.kvflow_options == {"llm.SyncKvCacheWaitTime": "20000", "llm.ListenIpInfo": "127.0.0.1:26000",
                                       "llm.DeviceId": "3"}
    assert settings.remote_cache_accessible and settings.require_local_ip
    # the original's own spellings, written by hand
    raw = llm_datadist._settings({"llm.listenIpInfo": "127.0.0.1:1", "ge.exec.deviceId": "1;2",
                                  "kvflow.Transports": "tcp", "llm.Unknown": "x"})
    assert raw.kvflow_options == {"llm.SyncKvCacheWaitTime": "1000", "llm.ListenIpInfo": "127.0.0.1:1",
                                  "llm.DeviceId": "1", "kvflow.Transports": "tcp"}
    assert not raw.remote_cache_accessible
    with pytest.raises(LLMException) as info:
        llm_datadist._settings({"llm.TransferBackend": "hixl"})  # needs a listen address, as there
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        config.sync_kv_timeout = 0
    with pytest.raises(TypeError):
        config.enable_cache_manager = 1  # type: ignore[assignment]


def test_cache_desc_checks_and_size() -> None:
    desc = CacheDesc(80, [4, 256], DataType.DT_FLOAT16)
    assert desc.placement == Placement.DEVICE and desc.batch_size == 4 and desc.size == 4 * 256 * 2
    with pytest.raises(TypeError):
        CacheDesc(2, [4, 2.0], DataType.DT_FLOAT)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        CacheDesc(2, [4], 1)  # type: ignore[arg-type]
    with pytest.raises(LLMException):
        CacheDesc(2, [4, 8], DataType.DT_FLOAT, batch_dim_index=2)
    folded = CacheDesc(1, [3, 4, 5], DataType.DT_INT8, batch_dim_index=1)._kvflow(Placement.HOST)
    assert list(folded.shape) == [4, 15] and folded.stride == 15
    key = BlocksCacheKey(prompt_cluster_id=7, model_id=2)
    assert (key.cluster_id, key.model_id) == (7, 2)
    with pytest.raises(LLMException):
        BlocksCacheKey(model_id=1)
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(1, "2")  # type: ignore[arg-type]


def test_placement_is_a_hint_for_int_addresses() -> None:
    arr = np.zeros(4096, np.uint8)
    addr = int(arr.ctypes.data)
    assert resolve_placement([addr], arr.nbytes, Placement.DEVICE) == Placement.HOST
    assert resolve_placement([addr], arr.nbytes, Placement.HOST) == Placement.HOST
    unmapped = 0x10  # the zero page is never mapped
    assert resolve_placement([unmapped], 64, Placement.DEVICE) == Placement.DEVICE  # NPU memory, say
    with pytest.raises(LLMException, match="not mapped"):
        resolve_placement([unmapped], 64, Placement.HOST)
    with pytest.raises(LLMException, match="mix host"):
        resolve_placement([addr, unmapped], 64, Placement.DEVICE)
    with pytest.raises(LLMException):  # runs past the end of the mapping into nothing
        resolve_placement([addr], 1 << 46, Placement.HOST)


def test_registration_rules(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, _ = pair
    cm = prompt.cache_manager
    arrays = [tensor(1), tensor(2)]
    addrs = [int(a.ctypes.data) for a in arrays]
    cache = cm.register_blocks_cache(blocks_desc(), addrs, BlocksCacheKey(PROMPT_CLUSTER_ID, 4))
    assert cache.cache_id == 1 and cache.is_blocks_cache and cache.tensor_addrs == addrs
    with pytest.raises(LLMException) as info:  # a key names one cache at a time
        cm.register_blocks_cache(blocks_desc(), addrs, BlocksCacheKey(5, 4))
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        cm.register_cache(blocks_desc(), addrs[:1])
    with pytest.raises(LLMException):
        cm.register_cache(blocks_desc(), [addrs[0], 0])
    with pytest.raises(TypeError):
        cm.register_cache(blocks_desc(), arrays)  # type: ignore[arg-type]
    with pytest.raises(LLMException) as info:
        cm.register_cache(blocks_desc(), addrs, cache_keys=[CacheKey(0, 1)])
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    cm.unregister_cache(cache.cache_id)
    cm.unregister_cache(cache.cache_id)  # unknown ids succeed
    again = cm.register_blocks_cache(blocks_desc(), addrs, BlocksCacheKey(PROMPT_CLUSTER_ID, 4))
    assert again.cache_id == 2


def test_transfers_by_key_and_their_errors(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = pair
    src = [tensor(1), tensor(2)]
    p_cache = prompt.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in src],
                                                        BlocksCacheKey(PROMPT_CLUSTER_ID, 9))
    dst = [np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32) for _ in range(NUM_TENSORS)]
    d_cache = decoder.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in dst])
    key = BlocksCacheKey(PROMPT_CLUSTER_ID, 9)
    with pytest.raises(LLMException) as info:
        decoder.cache_manager.pull_blocks(key, d_cache, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert prompt.listen_address is not None
    link(Board(None, None, "tcp"), decoder, PROMPT_CLUSTER_ID, prompt.listen_address[1])
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(LOCAL_IP, 0)
    cluster.append_remote_ip_info(LOCAL_IP, prompt.listen_address[1])
    assert decoder.link_clusters([cluster], 5000) == (LLMStatusCode.LLM_ALREADY_LINK, [LLMStatusCode.LLM_ALREADY_LINK])

    decoder.cache_manager.pull_blocks(key, d_cache, [2, 0], [0, 1], src_layer_range=range(1, 2),
                                      dst_layer_range=range(0, 1), tensor_num_per_layer=1)
    want = np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32)
    want[[0, 1]] = src[1][[2, 0]]
    assert np.array_equal(dst[0], want) and not dst[1].any()

    with pytest.raises(LLMException) as info:
        decoder.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 8), d_cache, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(LLMException) as info:
        decoder.cache_manager.pull_blocks(key, d_cache, [0], [3])  # past the last block
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:  # contiguous to blocks: not supported
        decoder.cache_manager.pull_blocks(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, p_cache.cache_id), d_cache, [],
                                          [0])
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    with pytest.raises(LLMException) as info:
        decoder.cache_manager.pull_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 1), d_cache)  # a blocks cache
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):  # remote cache access is on: only CacheKeyByIdAndIndex
        decoder.cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, 1), d_cache)

    # the peer re-registers under the same key: the next transfer finds the new cache
    prompt.cache_manager.unregister_cache(p_cache.cache_id)
    with pytest.raises(LLMException) as info:
        decoder.cache_manager.pull_blocks(key, d_cache, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    src2 = [tensor(7), tensor(8)]
    p_cache2 = prompt.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in src2],
                                                         BlocksCacheKey(PROMPT_CLUSTER_ID, 9))
    decoder.cache_manager.pull_blocks(key, d_cache, [0, 1, 2], [0, 1, 2])
    assert p_cache2.cache_id == 2 and all(np.array_equal(d, s) for d, s in zip(dst, src2))

    with pytest.raises(LLMException) as info:
        decoder.switch_role(LLMRole.PROMPT)
    assert info.value.status_code == LLMStatusCode.LLM_EXIST_LINK
    assert decoder.unlink_clusters([cluster], 5000) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    assert decoder.unlink_clusters([cluster], 5000, force=True) == (LLMStatusCode.LLM_SUCCESS,
                                                                    [LLMStatusCode.LLM_SUCCESS])


def test_link_failures_are_statuses_and_calls_check_their_arguments(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    _, decoder = pair
    with socket.socket() as s:  # a port nobody listens on
        s.bind((LOCAL_IP, 0))
        port = s.getsockname()[1]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 5
    cluster.append_local_ip_info(LOCAL_IP, 0)
    cluster.append_remote_ip_info(LOCAL_IP, port)
    assert decoder.link_clusters([cluster], 1000) == (LLMStatusCode.LLM_LINK_FAILED, [LLMStatusCode.LLM_LINK_FAILED])
    assert decoder.link_clusters([], 1000) == (LLMStatusCode.LLM_PARAM_INVALID, [])
    too_many = [cluster] * 17
    assert decoder.link_clusters(too_many, 1000)[0] == LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    no_local = LLMClusterInfo()
    no_local.remote_cluster_id = 5
    no_local.append_remote_ip_info(LOCAL_IP, port)
    with pytest.raises(LLMException):  # local_comm_res is "": the original wants a local address
        decoder.link_clusters([no_local])
    with pytest.raises(TypeError):
        decoder.link_clusters(cluster)  # type: ignore[arg-type]
    with pytest.raises(LLMException):
        decoder.link_clusters([cluster], 0)
    for call in (lambda: decoder.kv_cache_manager, lambda: decoder.link("c", {0: 0, 1: 1}, "{}"),
                 lambda: decoder.query_register_mem_status(1), lambda: decoder.cache_manager.allocate_cache(),
                 lambda: llm_datadist.KvCache()):
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    arrays = [tensor(1), tensor(2)]
    cache = decoder.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in arrays])
    with pytest.raises(TypeError):  # remote cache access is on: TransferWithCacheKeyConfig only, as there
        decoder.cache_manager.transfer_cache_async(cache, ComputeEvents(), [TransferConfig(0, [1, 2])])
    with pytest.raises(TypeError):
        decoder.cache_manager.transfer_cache_async(cache, object(), [])  # type: ignore[arg-type]


def test_push_needs_remote_cache_access_and_init_is_needed() -> None:
    datadist = LLMDataDist(LLMRole.MIX, 3)
    with pytest.raises(RuntimeError, match="not initialized"):
        datadist.cache_manager  # noqa: B018
    datadist.init({"kvflow.Transports": "tcp"})  # no local_comm_res, no remote cache access
    datadist.init({"kvflow.Transports": "tcp"})  # a second init does nothing
    try:
        arrays = [tensor(1), tensor(2)]
        cache = datadist.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in arrays])
        with pytest.raises(LLMException, match="enable_remote_cache_accessible"):
            datadist.cache_manager.push_blocks(BlocksCacheKey(1), cache, [0], [0])
        with pytest.raises(TypeError):  # without remote cache access: TransferConfig only
            datadist.cache_manager.transfer_cache_async(cache, ComputeEvents(), [
                TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 1), range(0, 1))])
        with pytest.raises(LLMException) as info:  # raw peer addresses: refused
            datadist.cache_manager.transfer_cache_async(cache, ComputeEvents(), [TransferConfig(1, [1, 2])])
        assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert datadist.listen_address is None and datadist.cluster_id == 3
    finally:
        datadist.finalize()
        datadist.finalize()
    with pytest.raises(TypeError):
        LLMDataDist(1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)


def test_cluster_ids_span_uint64() -> None:
    """0 and 2**64-1 are cluster ids like any other: they link, name keys and move bytes."""
    board = Board(None, None, "tcp")
    top = (1 << 64) - 1
    prompt = init_llm_datadist(board, LLMRole.PROMPT, top, local_comm_res="")
    decoder = init_llm_datadist(board, LLMRole.DECODER, 0, listen=False, local_comm_res="")
    try:
        src = [tensor(3), tensor(4)]
        prompt.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in src],
                                                   BlocksCacheKey(top, top))
        dst = [np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32) for _ in range(NUM_TENSORS)]
        d_cache = decoder.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in dst])
        assert prompt.listen_address is not None
        link(board, decoder, top, prompt.listen_address[1])
        decoder.cache_manager.pull_blocks(BlocksCacheKey(top, top), d_cache, [2, 1, 0], [0, 1, 2])
        assert all(np.array_equal(d, s[::-1]) for d, s in zip(dst, src))
        assert prompt.kvflow.link_info(0).state == "linked"
    finally:
        decoder.finalize()
        prompt.finalize()


def _doc_blocks() -> list[Any]:
    return [pytest.param(code, id=f"block{i}") for i, code in enumerate(python_blocks("docs/compat.md"))]


@pytest.mark.parametrize("code", _doc_blocks())
def test_docs_examples_run_as_written(code: str, tmp_path: Any) -> None:
    res = run_as_script(code, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_kvflow_keys_register_and_resolve() -> None:
    """The core side of BlocksCacheKey: ``register_kv_cache(key=)`` and ``resolve_cache_key``."""
    desc = kvflow.CacheDesc(2, kvflow.DataType.DT_UINT8, [4, 16])
    arrays = [np.zeros(64, np.uint8) for _ in range(4)]
    opts = {"kvflow.Transports": "tcp", "kvflow.HeartbeatTimeout": "10000"}
    with kvflow.sync.LlmDataDist(7, options={**opts, "llm.ListenIpInfo": "127.0.0.1:0"}) as server, \
            kvflow.sync.LlmDataDist(8, options=opts) as client:
        first = server.register_kv_cache(desc, arrays[:2], key=(1 << 64) - 1)
        with pytest.raises(kvflow.LLMParamInvalid, match="already names cache"):
            server.register_kv_cache(desc, arrays[2:], key=(1 << 64) - 1)
        with pytest.raises(kvflow.LLMParamInvalid):
            server.register_kv_cache(desc, arrays[2:], key=-1)
        assert server.listen_address is not None
        with pytest.raises(kvflow.LLMNotYetLink):
            client.resolve_cache_key(7, 1)
        rets = client.link_llm_clusters([kvflow.ClusterInfo(7, [kvflow.IpInfo(*server.listen_address)])], 5000)
        assert rets == [kvflow.LLMStatusCode.LLM_SUCCESS]
        assert client.resolve_cache_key(7, (1 << 64) - 1) == first.cache_id
        with pytest.raises(kvflow.LLMKvCacheNotExist):
            client.resolve_cache_key(7, 5)
        with pytest.raises(kvflow.LLMParamInvalid):
            client.resolve_cache_key(7, 1 << 64)
        server.unregister_kv_cache(first.cache_id)
        with pytest.raises(kvflow.LLMKvCacheNotExist):
            client.resolve_cache_key(7, (1 << 64) - 1)
        second = server.register_kv_cache(desc, arrays[2:], key=(1 << 64) - 1)  # the key is free again
        assert client.resolve_cache_key(7, (1 << 64) - 1) == second.cache_id == first.cache_id + 1


def test_transfer_cache_async_when_a_layer_never_comes(pair: tuple[LLMDataDist, LLMDataDist]) -> None:
    prompt, decoder = pair
    dst = [np.zeros((BLOCKS_NUM, KV_SHAPE), np.float32) for _ in range(NUM_TENSORS)]
    prompt.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in dst],
                                               BlocksCacheKey(PROMPT_CLUSTER_ID, 1))
    src = [tensor(1), tensor(2)]
    cache = decoder.cache_manager.register_blocks_cache(blocks_desc(), [int(a.ctypes.data) for a in src])
    assert prompt.listen_address is not None
    link(Board(None, None, "tcp"), decoder, PROMPT_CLUSTER_ID, prompt.listen_address[1])
    config = TransferWithCacheKeyConfig(BlocksCacheKey(PROMPT_CLUSTER_ID, 1), range(0, 1), range(0, 1))
    task = decoder.cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(False), [config])
    assert task.synchronize() == LLMStatusCode.LLM_FAILED
    assert task.get_results() == [LLMStatusCode.LLM_FAILED] and not any(a.any() for a in dst)
    task = decoder.cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(True), [config], [2], [1])
    assert task.get_results(timeout_in_millis=10_000) == [LLMStatusCode.LLM_SUCCESS]
    assert np.array_equal(dst[0][1], src[0][2]) and np.array_equal(dst[1][1], src[1][2])
    assert int(np.count_nonzero(dst[0])) == KV_SHAPE and int(np.count_nonzero(dst[1])) == KV_SHAPE
