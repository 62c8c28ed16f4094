"""The :class:`CacheManager` of :mod:`kvflow.compat.llm_datadist`: registration, pulls, pushes and
the layer-wise ``transfer_cache_async``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from ... import sync as _sync
from ..._layerwise import LayerSynchronizer
from ..._layerwise import TransferConfig as _KvTransferConfig
from ..._status import LLMException
from ..._types import Cache as _KvCache
from ..._types import CacheIndex, Placement
from .._placement import resolve_placement
from ._caches import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    TransferConfig,
    TransferWithCacheKeyConfig,
    _blocks,
    _check_per_layer,
    _inclusive,
    _pull_ext,
    _push_ext,
)
from ._config import _Settings
from ._status import (
    _TENSORS_PER_LAYER,
    LLMStatusCode,
    _check_type,
    _code,
    _int64,
    _invalid,
    _uint32,
    _uint64,
    _unsupported,
)

log = logging.getLogger("kvflow.compat.llm_datadist")


# ---------------------------------------------------------------------- CacheManager
@dataclass
class _Registered:
    """What a registration needs to be made again (``switch_role`` restarts the kvflow instance)."""

    cache: _KvCache
    key: int | None



class _Owner(Protocol):
    """What a :class:`CacheManager` uses of its :class:`LLMDataDist` (kept apart so that this module
    does not import the one that defines it)."""

    _caches: dict[int, _Registered]
    _next_cache_id: int

    def _require(self) -> _sync.LlmDataDist: ...

    def _settings_or_raise(self) -> _Settings: ...


class CacheManager:
    """Registers caches and moves them: ``datadist.cache_manager``. Every call blocks."""

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner

    # ------------------------------------------------------------------ registration
    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register a contiguous (batch) cache: ``len(addrs) == num_tensors`` int addresses.
        ``cache_keys`` must be empty (CacheKey is not supported); ``remote_accessible`` is ignored."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int, allow_none=False)
        _check_type("cache_keys", cache_keys, (tuple, list), CacheKey)
        _check_type("remote_accessible", remote_accessible, bool)
        if cache_keys:
            _unsupported("register_cache(cache_keys=...)", "kvflow names a cache by its id; peers use "
                         "CacheKeyByIdAndIndex")
        return self._register("register_cache", cache_desc, addrs, None)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register a blocks (PagedAttention) cache: ``shape[0]`` is the number of blocks. With
        ``blocks_cache_key``, peers find it by ``BlocksCacheKey(<this cluster>, model_id)``
        (one cache per model_id at a time); ``remote_accessible`` is ignored."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int, allow_none=False)
        _check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        _check_type("remote_accessible", remote_accessible, bool)
        key = None if blocks_cache_key is None else _uint64("model_id", blocks_cache_key.model_id)
        return self._register("register_blocks_cache", cache_desc, addrs, key, blocks=True)

    def _register(self, what: str, desc: CacheDesc, addrs: list[int], key: int | None,
                  blocks: bool = False) -> Cache:
        owner = self._owner
        dd = owner._require()
        if not addrs:
            _invalid("addrs can not be empty.")
        if len(addrs) != desc.num_tensors:
            _invalid("addrs length should be equal to num_tensors.")
        if any(a == 0 for a in addrs):
            _invalid("addr can not be zero.")
        kv_desc = desc._kvflow(Placement.HOST)  # validates the data type
        placement = resolve_placement(addrs, kv_desc.tensor_bytes, desc.placement)
        kv_cache = dd.register_kv_cache(desc._kvflow(placement), list(addrs), key=key)
        owner._caches[kv_cache.cache_id] = _Registered(kv_cache, key)
        owner._next_cache_id = max(owner._next_cache_id, kv_cache.cache_id + 1)
        log.debug("[%s] cache_id=%d placement=%s key=%s", what, kv_cache.cache_id, placement.name, key)
        return Cache(kv_cache.cache_id, desc, list(addrs), self, True, blocks)

    def unregister_cache(self, cache_id: int) -> None:
        """Unregister a cache (call it after unlinking, as in the original). Unknown ids succeed."""
        _check_type("cache_id", cache_id, int, allow_none=False)
        _int64("cache_id", cache_id)
        dd = self._owner._require()
        if cache_id <= 0:
            return
        dd.unregister_kv_cache(cache_id)
        self._owner._caches.pop(cache_id, None)

    def _kv(self, cache: Cache) -> _KvCache:
        """kvflow's Cache for ``cache`` (a stand-in with its id when it is not registered here, so that
        kvflow answers LLM_KV_CACHE_NOT_EXIST)."""
        reg = self._owner._caches.get(cache.cache_id)
        if reg is not None:
            return reg.cache
        return _KvCache(max(cache.cache_id, 0), tuple(cache.tensor_addrs),
                        cache.cache_desc._kvflow(Placement.HOST))

    def _remote_blocks(self, dd: _sync.LlmDataDist, key: BlocksCacheKey) -> CacheIndex:
        """The peer's blocks cache that ``key`` names, resolved over the link."""
        cluster = _uint64("cluster_id", key.cluster_id)
        return CacheIndex(cluster, dd.resolve_cache_key(cluster, _uint64("model_id", key.model_id)))

    # ------------------------------------------------------------------ pulls
    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, *, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy the peer's slot ``cache_key.batch_index`` into local slot ``batch_index`` (``size``
        bytes per tensor; -1: the whole slot), optionally only some layers."""
        if self._owner._settings_or_raise().remote_cache_accessible:
            _check_type("cache_key", cache_key, CacheKeyByIdAndIndex, allow_none=False)
        else:
            _check_type("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex), allow_none=False)
        _check_type("cache", cache, Cache, allow_none=False)
        _uint32("batch_index", batch_index)
        _int64("size", size)
        if cache.is_blocks_cache:
            _invalid("param check failed, cache can not be blocks cache.")
        if not (size == -1 or size > 0):
            _invalid(f"[pull_cache] param check failed, size ({size}) is invalid, should be = -1 or > 0")
        n = _check_per_layer("pull_cache", tensor_num_per_layer, cache.cache_desc.num_tensors)
        if isinstance(cache_key, CacheKey):
            _unsupported("pull_cache(CacheKey)", "name the peer's cache with CacheKeyByIdAndIndex")
        ext = _pull_ext(src_layer_range, dst_layer_range, n, cache.cache_desc.num_tensors)
        dd = self._owner._require()
        index = CacheIndex(cache_key.cluster_id, cache_key.cache_id, cache_key.batch_index)
        dd.pull_kv_cache(index, self._kv(cache), batch_index, size, ext)

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                    src_blocks: list[int] | tuple[int, ...] | None = (), dst_blocks: list[int] | tuple[int, ...] = (),
                    *, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy the peer's ``src_blocks`` (of the blocks cache ``src_cache_key`` names) into local
        ``dst_blocks``, pairwise, optionally only some layers."""
        _check_type("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey),
                    allow_none=False)
        _check_type("dst_cache", dst_cache, Cache, allow_none=False)
        src = _blocks("src_blocks", src_blocks)
        dst = _blocks("dst_blocks", dst_blocks)
        if not dst_cache.is_blocks_cache:
            _invalid("param check failed, dst_cache should be blocks cache.")
        if not dst:
            _invalid("dst_blocks can not be empty.")
        n = _check_per_layer("pull_blocks", tensor_num_per_layer, dst_cache.cache_desc.num_tensors)
        if not isinstance(src_cache_key, BlocksCacheKey):
            if src:
                _invalid("src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.")
            _unsupported("pull_blocks from a contiguous cache into blocks",
                         "kvflow moves whole blocks between caches of equal block size")
        if not src:
            _invalid("src_blocks can not be empty.")
        ext = _pull_ext(src_layer_range, dst_layer_range, n, dst_cache.cache_desc.num_tensors)
        dd = self._owner._require()
        dd.pull_kv_blocks(self._remote_blocks(dd, src_cache_key), self._kv(dst_cache), src, dst, ext)

    # ------------------------------------------------------------------ pushes
    def _check_push(self, what: str) -> None:
        if not self._owner._settings_or_raise().remote_cache_accessible:
            _invalid(f"{what} is only supported while enable_remote_cache_accessible is True")

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy local slot ``src_batch_index`` into the peer's slot ``dst_cache_key.batch_index``
        (every layer of the source by default). Needs ``enable_remote_cache_accessible``."""
        self._check_push("push_cache")
        _check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        _uint32("src_batch_index", src_batch_index)
        if src_cache.is_blocks_cache:
            _invalid("param check failed, cache can not be blocks cache.")
        n = _check_per_layer("push_cache", tensor_num_per_layer, src_cache.cache_desc.num_tensors)
        ext = _push_ext(src_layer_range, dst_layer_range, n, src_cache.cache_desc.num_tensors)
        _int64("size", size)
        if size != -1:
            _invalid(f"[push_cache] param check failed, size ({size}) is invalid, should be = -1.")
        dd = self._owner._require()
        index = CacheIndex(dst_cache_key.cluster_id, dst_cache_key.cache_id, dst_cache_key.batch_index)
        dd.push_kv_cache(self._kv(src_cache), index, src_batch_index, -1, ext)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: list[int] | tuple[int, ...] | None = (), dst_blocks: list[int] | tuple[int, ...] = (),
                    src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy local ``src_blocks`` into the peer's ``dst_blocks`` of the blocks cache
        ``dst_cache_key`` names (every layer of the source by default). Needs
        ``enable_remote_cache_accessible``."""
        self._check_push("push_blocks")
        _check_type("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        src = _blocks("src_blocks", src_blocks)
        dst = _blocks("dst_blocks", dst_blocks)
        if not src_cache.is_blocks_cache:
            _invalid("param check failed, cache should be blocks cache.")
        if not dst:
            _invalid("dst_blocks can not be empty.")
        n = _check_per_layer("push_blocks", tensor_num_per_layer, src_cache.cache_desc.num_tensors)
        ext = _push_ext(src_layer_range, dst_layer_range, n, src_cache.cache_desc.num_tensors)
        dd = self._owner._require()
        dd.push_kv_blocks(self._kv(src_cache), self._remote_blocks(dd, dst_cache_key), src, dst, ext)

    # ------------------------------------------------------------------ layer-wise push
    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferWithCacheKeyConfig | TransferConfig],
                             src_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer (two tensors per layer) to every config's peer cache, each
        layer once ``layer_synchronizer`` says it is computed; returns a :class:`CacheTask` at once.

        With block indices: those blocks; without: slot ``src_batch_index`` to the destination's slot
        (``batch_index``, 0 for a ``BlocksCacheKey``). A config whose peer cache cannot be found
        (no link, unknown key) fails in the task's results; the others go on."""
        settings = self._owner._settings_or_raise()
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        if src_cache.cache_desc.placement == Placement.HOST:
            _invalid("src cache not support placement HOST")
        src_idx = _blocks("src_block_indices", src_block_indices) if src_block_indices is not None else None
        dst_idx = _blocks("dst_block_indices", dst_block_indices) if dst_block_indices is not None else None
        for name, idx in (("src_block_indices", src_idx), ("dst_block_indices", dst_idx)):
            for v in idx or ():
                _uint64(name, v)
        if dst_block_memory_size is not None:
            _uint64("dst_block_memory_size", dst_block_memory_size)
        if src_idx:
            if not dst_idx:
                _invalid("transfer from blocks to cache is not supported")
            if len(src_idx) != len(dst_idx):
                _invalid(f"num_block_indices mismatches, src_num = {len(src_idx)}, dst_num = {len(dst_idx)}")
        elif dst_idx:
            _unsupported("transfer_cache_async from a contiguous cache into blocks",
                         "kvflow moves whole blocks between caches of equal block size")
        if not isinstance(layer_synchronizer, LayerSynchronizer):
            raise TypeError("layer_synchronizer only support ['LayerSynchronizer'], "
                            f"but got {type(layer_synchronizer)}.")
        want = TransferWithCacheKeyConfig if settings.remote_cache_accessible else TransferConfig
        _check_type("transfer_configs", transfer_configs, (list, tuple), want, allow_none=False)
        if not (dst_idx or dst_block_memory_size in (None, 0)):
            _invalid(f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 while dst is not blocks")
        num_tensors = src_cache.cache_desc.num_tensors
        if num_tensors % _TENSORS_PER_LAYER:
            _invalid(f"cache_desc.num_tensors ({num_tensors}) is not even")
        num_layers = num_tensors // _TENSORS_PER_LAYER
        configs: list[TransferWithCacheKeyConfig] = []
        for cfg in transfer_configs:
            if isinstance(cfg, TransferConfig):
                _unsupported("transfer_cache_async(TransferConfig)", "kvflow reaches a peer's memory only through "
                             "its registered caches: enable remote cache access, use TransferWithCacheKeyConfig")
            configs.append(cfg)
            rng = cfg.src_layer_range
            if src_idx and cfg.src_batch_index != 0:
                _invalid(f"Invalid TransferConfig, src_batch_index ({cfg.src_batch_index}) != 0 while src is blocks")
            if not 0 <= rng.start < rng.stop <= num_layers:
                _invalid(f"src_layer_range: {rng} out of range, src_layer_num = {num_layers}")
        dd = self._owner._require()
        kv_configs: list[_KvTransferConfig] = []
        slots: list[int | None] = []
        early: dict[int, LLMStatusCode] = {}
        for i, cfg in enumerate(configs):
            key = cfg.cache_key
            try:
                if isinstance(key, BlocksCacheKey):
                    index = self._remote_blocks(dd, key)
                else:
                    index = CacheIndex(key.cluster_id, key.cache_id, key.batch_index)
            except LLMException as exc:
                log.warning("transfer_cache_async: config %d (%r): %s", i, key, exc)
                early[i] = _code(exc.status_code)
                slots.append(None)
                continue
            slots.append(len(kv_configs))
            kv_configs.append(_KvTransferConfig(index, _inclusive(cfg.src_layer_range),
                                                _inclusive(cfg.dst_layer_range), cfg.src_batch_index))
        task = None
        if kv_configs:
            task = dd.transfer_cache_async(self._kv(src_cache), layer_synchronizer, kv_configs, src_idx or None,
                                           dst_idx or None, _TENSORS_PER_LAYER)
        return CacheTask(task, slots, early)

    # ------------------------------------------------------------------ not supported
    def allocate_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported (register your own memory)."""
        _unsupported("allocate_cache", "deprecated; register memory you allocated with register_cache")

    def allocate_blocks_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("allocate_blocks_cache", "deprecated; register memory you allocated with register_blocks_cache")

    def deallocate_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("deallocate_cache", "deprecated; use unregister_cache")

    def deallocate_blocks_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("deallocate_blocks_cache", "deprecated; use unregister_cache")

    def remove_cache_key(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("remove_cache_key", "deprecated; CacheKey is not supported")

    def copy_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("copy_cache", "deprecated local copy")

    def copy_blocks(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("copy_blocks", "deprecated local copy")

    def swap_blocks(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("swap_blocks", "deprecated host/device swap")

    def remap_registered_memory(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Reserved in the original: not supported."""
        _unsupported("remap_registered_memory", "reserved for device memory faults")
