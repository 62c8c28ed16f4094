"""A linked prefill/decode pair for tests: the prefill side runs in a child process.

:func:`open_pair` starts a child process holding a prefill ``LlmDataDist`` (cluster 1) with one
registered cache, and links a local decode ``LlmDataDist`` (cluster 2) with its own cache to it.
The returned :class:`KvPair` drives the child over a pipe: fill or read its cache, register more,
make it push into (or pull from) the local cache, or kill it. The ``kvflow_pair`` fixture of the
pytest plugin is this, set up and torn down per test.
"""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Mapping, Sequence

import numpy as np

from .._datadist import LlmDataDist
from .._proc import PeerProcess, recv_from_parent
from .._status import LLMException
from .._types import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmRole
from . import _inspect as inspect

__all__ = ["KvPair", "PairConfig", "open_pair", "pattern"]

PREFILL_CLUSTER = 1
DECODE_CLUSTER = 2


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """``nbytes`` deterministic pseudo-random bytes (what ``fill=seed`` writes into a tensor)."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@dataclass(frozen=True)
class PairConfig:
    """How ``kvflow_pair`` is built; override the ``kvflow_pair_config`` fixture or use the
    ``kvflow_pair(...)`` marker (its keyword arguments replace these fields)."""

    #: Layout of both caches (the example in LLM-DataDist's KV cache management guide: 4 tensors of 8 x 16 int32).
    desc: CacheDesc = field(default_factory=lambda: CacheDesc(4, DataType.DT_INT32, [8, 16]))
    #: ``kvflow.Transports`` for both sides (``None``: kvflow's default preference).
    transport: str | None = None
    #: Extra ``initialize`` options for both sides.
    options: Mapping[str, str] = field(default_factory=dict)
    #: Remote (prefill) cache content: a seed for :func:`pattern` per tensor (seed + t), or None for zeros.
    remote_fill: int | None = 1000
    #: Link through a :class:`~kvflow.testing.FaultProxy` (``pair.proxy``): control and data
    #: connections then pass through it and can be stalled, truncated or dropped.
    proxy: bool = False
    #: Link timeout and the child's start-up bound.
    link_timeout_ms: int = 10_000
    start_timeout_s: float = 60.0


def _initialize_options(cfg: PairConfig) -> dict[str, str]:
    opts = dict(cfg.options)
    if cfg.transport is not None:
        opts["kvflow.Transports"] = cfg.transport
    return opts


def _arrays(desc: CacheDesc, fill: int | None) -> list[np.ndarray]:
    return [pattern(fill + t, desc.tensor_bytes) if fill is not None else np.zeros(desc.tensor_bytes, np.uint8)
            for t in range(desc.num_tensors)]


def _desc_args(desc: CacheDesc) -> tuple[int, int, list[int]]:
    return desc.num_tensors, int(desc.data_type), [int(x) for x in desc.shape]


# ---------------------------------------------------------------------- the child (prefill side)
async def prefill_main(conn: Connection) -> None:
    """Child process: a prefill LlmDataDist that does what the parent asks, one command at a time."""
    options = conn.recv()
    dd = LlmDataDist(PREFILL_CLUSTER, LlmRole.PROMPT)
    await dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", **options})
    arrays: dict[int, list[np.ndarray]] = {}
    caches: dict[int, Cache] = {}
    conn.send(("ready", dd.listen_address))
    try:
        while True:
            msg = await recv_from_parent(conn)
            if msg == "stop":
                break
            op, args = msg
            try:
                conn.send(("ok", await _command(dd, arrays, caches, op, *args)))
            except LLMException as exc:
                conn.send(("err", exc))
            except Exception:
                conn.send(("crash", traceback.format_exc()))
    finally:
        await dd.finalize()


async def _command(dd: LlmDataDist, arrays: dict[int, list[np.ndarray]], caches: dict[int, Cache],
                   op: str, *args: Any) -> Any:
    if op == "register":
        (num_tensors, dtype, shape), fill = args
        desc = CacheDesc(num_tensors, DataType(dtype), list(shape))
        arrs = _arrays(desc, fill)
        cache = await dd.register_kv_cache(desc, arrs)
        arrays[cache.cache_id], caches[cache.cache_id] = arrs, cache
        return cache.cache_id
    if op == "read":
        return [a.copy() for a in arrays[args[0]]]
    if op == "write":
        cache_id, data = args
        for a, d in zip(arrays[cache_id], data, strict=True):
            a[:] = np.frombuffer(memoryview(d).cast("B"), dtype=np.uint8)
        return None
    if op == "unregister":
        await dd.unregister_kv_cache(args[0])
        arrays.pop(args[0], None)
        caches.pop(args[0], None)
        return None
    if op == "transfer":
        kind, cache_id, dst, a, b, ext = args
        cache = caches[cache_id]
        ext_p = ext  # a KvCacheExtParam (pickled) or None
        ci = CacheIndex(*dst)
        if kind == "push_blocks":
            await dd.push_kv_blocks(cache, ci, a, b, ext_p)
        elif kind == "pull_blocks":
            await dd.pull_kv_blocks(ci, cache, a, b, ext_p)
        elif kind == "push_cache":
            await dd.push_kv_cache(cache, ci, a, -1, ext_p)
        elif kind == "pull_cache":
            await dd.pull_kv_cache(ci, cache, a, -1, ext_p)
        else:
            raise ValueError(f"unknown transfer {kind!r}")
        return None
    if op == "notify":  # send a notification to a linked cluster
        await dd.send_notification(*args)
        return None
    if op == "notes":  # take the notifications received so far
        return dd.get_notifications()
    if op == "stats":
        return dd.stats()
    if op == "links":
        return {cid: dd.link_info(cid).state for cid in list(inspect.links(dd))}
    raise ValueError(f"unknown command {op!r}")


async def command(child: PeerProcess, op: str, *args: Any, timeout: float = 30.0) -> Any:
    """Send one command to a :func:`prefill_main` child and return its answer; the child's
    ``LLMException`` is raised here, typed; a crash there is an AssertionError with its traceback."""
    child.send((op, args))
    kind, value = await child.recv(timeout)
    if kind == "err":
        raise value
    if kind == "crash":
        raise AssertionError(f"the prefill child process failed:\n{value}")
    return value


# ---------------------------------------------------------------------- the parent (decode side)
class KvPair:
    """A local decode ``LlmDataDist`` linked to a prefill ``LlmDataDist`` in a child process.

    Attributes a test uses directly:

    - ``dd``: the local (decode) ``LlmDataDist``, cluster ``local_cluster_id``;
    - ``cache``: the local ``Cache``, ``local``: its tensors (flat ``uint8`` arrays), zeros at first;
    - ``remote``: ``CacheIndex`` of the child's cache (fill given by ``PairConfig.remote_fill``);
    - ``desc``: the layout of both caches; ``remote_cluster_id``; ``peer``: the child process.
    """

    def __init__(self, cfg: PairConfig, peer: PeerProcess, dd: LlmDataDist, address: tuple[str, int]) -> None:
        self.config = cfg
        self.desc = cfg.desc
        self.peer = peer
        self.dd = dd
        self.address = address
        self.remote_cluster_id = PREFILL_CLUSTER
        self.local_cluster_id = DECODE_CLUSTER
        self.cache: Cache
        self.local: list[np.ndarray] = []
        self.remote: CacheIndex
        self.proxy: Any = None  # the FaultProxy when PairConfig.proxy

    def __repr__(self) -> str:
        return (f"<KvPair local={self.local_cluster_id} remote={self.remote_cluster_id} pid={self.peer.pid} "
                f"transport={self.transport}>")

    @property
    def transport(self) -> str | None:
        """The transport the link negotiated (None once it is gone)."""
        link = inspect.links(self.dd).get(self.remote_cluster_id)
        return link.transport if link is not None else None

    def blocks(self, arr: np.ndarray) -> np.ndarray:
        """One tensor's bytes as ``[num_blocks, bytes per block]``."""
        return arr.reshape(self.desc.num_blocks, self.desc.stride)

    def local_index(self, batch_index: int = 0) -> CacheIndex:
        """The local cache as the child addresses it (for ``remote_push_*``)."""
        return CacheIndex(self.local_cluster_id, self.cache.cache_id, batch_index)

    # ---------------------------------------------------------------- the child's side
    async def call(self, op: str, *args: Any, timeout: float = 30.0) -> Any:
        """Send one command to the child; its ``LLMException`` is raised here, typed."""
        return await command(self.peer, op, *args, timeout=timeout)

    async def remote_read(self, cache: CacheIndex | None = None) -> list[np.ndarray]:
        """A copy of every tensor of the child's cache (flat ``uint8``)."""
        return await self.call("read", (cache or self.remote).cache_id)

    async def remote_write(self, tensors: Sequence[Any], cache: CacheIndex | None = None) -> None:
        """Overwrite the child's cache with ``tensors`` (one buffer of ``tensor_bytes`` per tensor)."""
        data = [np.ascontiguousarray(t).tobytes() for t in tensors]
        await self.call("write", (cache or self.remote).cache_id, data)

    async def remote_register(self, desc: CacheDesc | None = None, fill: int | None = None) -> CacheIndex:
        """Register one more cache in the child; returns its index (batch 0)."""
        cid = await self.call("register", _desc_args(desc or self.desc), fill)
        return CacheIndex(self.remote_cluster_id, int(cid))

    async def remote_unregister(self, cache: CacheIndex | None = None) -> None:
        await self.call("unregister", (cache or self.remote).cache_id)

    async def remote_push_blocks(self, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                                 ext_param: KvCacheExtParam | None = None, *,
                                 remote: CacheIndex | None = None) -> None:
        """The child pushes its ``src_blocks`` into the local cache's ``dst_blocks`` (prefill -> decode)."""
        await self._remote_transfer("push_blocks", remote, 0, list(map(int, src_blocks)),
                                    list(map(int, dst_blocks)), ext_param)

    async def remote_pull_blocks(self, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                                 ext_param: KvCacheExtParam | None = None, *,
                                 remote: CacheIndex | None = None) -> None:
        """The child pulls the local cache's ``src_blocks`` into its own ``dst_blocks``."""
        await self._remote_transfer("pull_blocks", remote, 0, list(map(int, src_blocks)),
                                    list(map(int, dst_blocks)), ext_param)

    async def remote_push_cache(self, src_batch_index: int = 0, dst_batch_index: int = 0,
                                ext_param: KvCacheExtParam | None = None, *,
                                remote: CacheIndex | None = None) -> None:
        """The child pushes its batch slot ``src_batch_index`` into local slot ``dst_batch_index``."""
        await self._remote_transfer("push_cache", remote, dst_batch_index, int(src_batch_index), None, ext_param)

    async def _remote_transfer(self, kind: str, remote: CacheIndex | None, local_batch: int, a: Any, b: Any,
                               ext: KvCacheExtParam | None) -> None:
        await self.call("transfer", kind, (remote or self.remote).cache_id,
                        (self.local_cluster_id, self.cache.cache_id, int(local_batch)), a, b, ext)

    async def remote_stats(self) -> dict[str, Any]:
        """The child's ``LlmDataDist.stats()``."""
        return await self.call("stats")

    def kill_remote(self) -> None:
        """SIGKILL the child (a crashed prefill worker); the link breaks within the heartbeat timeout."""
        import os
        import signal

        if self.peer.proc.is_alive():
            os.kill(self.peer.pid, signal.SIGKILL)
            self.peer.proc.join(10)

    async def close(self) -> None:
        """Finalize the local side, then stop the child (bounded)."""
        try:
            await self.dd.finalize()
        finally:
            try:
                if self.proxy is not None:
                    await self.proxy.close()
            finally:
                await asyncio.get_running_loop().run_in_executor(None, self.peer.stop)


async def open_pair(cfg: PairConfig | None = None) -> KvPair:
    """Start the prefill child, register both caches, link them; ``await pair.close()`` when done."""
    cfg = cfg or PairConfig()
    cfg.desc.validate()
    opts = _initialize_options(cfg)
    peer = PeerProcess(prefill_main)
    dd: LlmDataDist | None = None
    pair: KvPair | None = None
    try:
        peer.send(opts)
        kind, address = await peer.recv(cfg.start_timeout_s)
        if kind != "ready":
            raise RuntimeError(f"kvflow_pair peer process did not start: {kind!r}")
        dd = LlmDataDist(DECODE_CLUSTER, LlmRole.DECODER)
        await dd.initialize(opts)
        pair = KvPair(cfg, peer, dd, tuple(address))
        pair.remote = CacheIndex(PREFILL_CLUSTER, int(await pair.call("register", _desc_args(cfg.desc),
                                                                       cfg.remote_fill)))
        pair.local = _arrays(cfg.desc, None)
        pair.cache = await dd.register_kv_cache(cfg.desc, pair.local)
        target = tuple(address)
        if cfg.proxy:
            from ._proxy import FaultProxy

            pair.proxy = proxy = await FaultProxy(target).start()
            target = proxy.address
        rets = await dd.link_llm_clusters([ClusterInfo(PREFILL_CLUSTER, [IpInfo(*target)])], cfg.link_timeout_ms)
        if [int(r) for r in rets] != [0]:
            raise RuntimeError(f"kvflow_pair could not link to its peer process: {rets[0]!r}")
        return pair
    except BaseException:
        if pair is not None:
            await pair.close()
        else:
            if dd is not None:
                await dd.finalize()
            peer.stop()
        raise
