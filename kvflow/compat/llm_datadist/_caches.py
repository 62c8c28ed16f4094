"""Cache descriptions and handles, the keys that name a peer's cache, the transfer configs,
:class:`CacheTask` and the layer-range helpers of :mod:`kvflow.compat.llm_datadist`."""

from __future__ import annotations

from typing import Any

from ... import sync as _sync
from ..._status import LLMException, LLMParamInvalid
from ..._types import CacheDesc as _KvCacheDesc
from ..._types import DataType as _KvDataType
from ..._types import KvCacheExtParam, Placement
from ._status import (
    _INVALID_ID,
    _TENSORS_PER_LAYER,
    DataType,
    LLMStatusCode,
    _check_type,
    _code,
    _int32,
    _int64,
    _invalid,
    _uint32,
    _uint64,
    _unsupported,
)


# ---------------------------------------------------------------------- cache types
class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type``; ``shape[batch_dim_index]`` is the
    number of blocks (blocks cache) or the batch size. ``placement`` is a hint (docs/compat.md)."""

    def __init__(self, num_tensors: int, shape: list[int] | tuple[int, ...], data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0, seq_len_dim_index: int = -1,
                 kv_tensor_format: str | None = None) -> None:
        _uint32("num_tensors", num_tensors)
        _check_type("shape", shape, (tuple, list), int)
        _check_type("data_type", data_type, DataType)
        _check_type("placement", placement, Placement)
        _check_type("batch_dim_index", batch_dim_index, int)
        _int32("seq_len_dim_index", seq_len_dim_index)
        _check_type("kv_tensor_format", kv_tensor_format, str)
        if not 0 <= batch_dim_index < len(shape):
            _invalid(f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})")
        if not (seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape)):
            _invalid(f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range [0, {len(shape)})")
        for d in shape:
            _int64("shape", d)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, data_type={self._data_type}, "
                f"placement={self._placement}, batch_dim_index={self._batch_dim}, "
                f"seq_len_dim_index={self._seq_len_dim_index},kv_tensor_format={self._kv_tensor_format})")

    @property
    def num_tensors(self) -> int:
        """Number of tensors."""
        return self._num_tensors

    @property
    def shape(self) -> list[int] | tuple[int, ...]:
        """Shape of one tensor."""
        return self._shape

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Change one dimension of ``shape`` (before registering)."""
        self._shape[dim_index] = dim_value  # type: ignore[index]

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Declared placement (a hint, see docs/compat.md)."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """Index of the batch (blocks) dimension."""
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim]``."""
        return self._shape[self._batch_dim]

    @property
    def seq_len_dim_index(self) -> int:
        """Accepted and unused."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Accepted and unused."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        n = _kv_dtype(self._data_type).itemsize
        for d in self._shape:
            n *= d
        return n

    def _kvflow(self, placement: Placement) -> _KvCacheDesc:
        """kvflow's description: the same bytes, with the batch (blocks) dimension first."""
        shape = list(self._shape)
        if self._batch_dim != 0:
            rest = 1
            for i, d in enumerate(shape):
                if i != self._batch_dim:
                    rest *= d
            shape = [shape[self._batch_dim], rest]
        return _KvCacheDesc(self._num_tensors, _kv_dtype(self._data_type), shape, placement)


def _kv_dtype(data_type: DataType) -> _KvDataType:
    try:
        return _KvDataType(data_type.value)
    except ValueError:
        raise LLMParamInvalid(f"data_type {data_type} has no fixed element size") from None


class Cache:
    """A registered cache: returned by ``register_cache``/``register_blocks_cache``, not built by hand
    (except :meth:`create_cpu_cache`, which registers nothing)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int], cache_manager: Any = None,
                 is_registered: bool = True, is_blocks_cache: bool = False) -> None:
        self._cache_id = _int64("cache_id", cache_id)
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache

    @property
    def cache_id(self) -> int:
        """Its id (ids start at 1); -1 for :meth:`create_cpu_cache`."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Its description, as given."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """The address of each tensor."""
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        """Registered with ``register_blocks_cache``."""
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """A host-memory description for the deprecated ``swap_blocks`` (which kvflow refuses)."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int)
        if cache_desc.placement != Placement.HOST:
            _invalid("cache_desc placement must be HOST")
        if cache_desc.num_tensors != len(addrs):
            _invalid(f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}")
        return cls(-1, cache_desc, addrs, None, False, True)

    def __repr__(self) -> str:
        return (f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = {len(self._tensor_addrs)}, "
                f"is_blocks_cache = {self._is_blocks_cache})")


class KvCache:
    """The V1 ``KvCacheManager``'s cache: not supported (kvflow implements the V2 API)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("KvCache", "it belongs to the V1 KvCacheManager API")


class BlocksCacheKey:
    """Names a peer's blocks cache: ``BlocksCacheKey(cluster_id, model_id=0)`` (or ``prompt_cluster_id=``).

    At registration only ``model_id`` counts (it becomes the kvflow key of the cache); in a transfer
    ``cluster_id`` says which peer, and the link resolves ``model_id`` to that peer's cache."""

    def __init__(self, *args: int, **kwargs: int) -> None:
        if len(args) + len(kwargs) > 2:
            _invalid("Param num is over limit")
        if args:
            kwargs["cluster_id"] = args[0]
        if len(args) > 1:
            kwargs["model_id"] = args[1]
        if "prompt_cluster_id" not in kwargs and "cluster_id" not in kwargs:
            _invalid("Param prompt_cluster_id or cluster_id is required")
        for k in kwargs:
            if k not in ("prompt_cluster_id", "cluster_id", "model_id"):
                _invalid(f"Unsupported param:{k}")
        self._key_name = "cluster_id" if "cluster_id" in kwargs else "prompt_cluster_id"
        self._cluster_id = kwargs[self._key_name]
        self._model_id = kwargs.get("model_id", 0)
        _check_type("cluster_id", self._cluster_id, int, allow_none=False)
        _check_type("model_id", self._model_id, int, allow_none=False)

    @property
    def cluster_id(self) -> int:
        """The peer that holds the cache (ignored at registration)."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Which of that peer's blocks caches."""
        return self._model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._key_name}={self._cluster_id}, model_id={self._model_id})"


class CacheKey:
    """A cache named by request (``req_id``) or prefix: accepted as a value, refused by every call
    (kvflow names caches by id or by ``BlocksCacheKey``)."""

    def __init__(self, *args: int, **kwargs: int) -> None:
        if len(args) + len(kwargs) > 4:
            _invalid("Param num is over limit")
        for name, value in zip(("cluster_id", "req_id", "model_id", "prefix_id"), args):
            kwargs[name] = value
        if "prompt_cluster_id" not in kwargs and "cluster_id" not in kwargs:
            _invalid("Param prompt_cluster_id or cluster_id is required")
        if "req_id" not in kwargs:
            _invalid("Param req_id is required")
        for k in kwargs:
            if k not in ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"):
                _invalid(f"Unsupported param:{k}")
        self._cluster_id = _uint64("cluster_id", kwargs.get("cluster_id", kwargs.get("prompt_cluster_id")))
        self._req_id = _uint64("req_id", kwargs["req_id"])
        self._model_id = _uint64("model_id", kwargs.get("model_id", 0))
        self._prefix_id = _uint64("prefix_id", kwargs.get("prefix_id", _INVALID_ID))

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id."""
        return self._req_id

    @property
    def prefix_id(self) -> int:
        """Prefix id (2**64-1: none)."""
        return self._prefix_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, prefix_id={self._prefix_id}, "
                f"model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """Names one batch slot of a peer's cache: ``(cluster_id, cache_id, batch_index=0)``."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = _uint64("cluster_id", cluster_id)
        self._cache_id = _int64("cache_id", cache_id)
        self._batch_index = _uint32("batch_index", batch_index)

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """The id the peer's ``register_*`` returned."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """The slot."""
        return self._batch_index

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")


def _check_layer_range(name: str, value: Any, allow_none: bool = True) -> None:
    if allow_none and value is None:
        return
    _check_type(name, value, range, allow_none=allow_none)
    if value.step != 1:
        _invalid(f"check {name}.step == 1 failed")
    if not 0 <= value.start < value.stop:
        _invalid(f"check 0 <= range.start < range.stop failed, {name} = {value}")


class TransferWithCacheKeyConfig:
    """One destination of ``transfer_cache_async``: a peer's cache (``BlocksCacheKey`` or
    ``CacheKeyByIdAndIndex``), the source and destination layers (``range``s of equal length) and the
    source slot."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_layer_range: range | None = None,
                 dst_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        _check_type("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False)
        _check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        _check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        if len(src_layer_range) != len(dst_layer_range):
            _invalid("src_layer_range size should be equal to dst_layer_range size")
        _uint32("src_batch_index", src_batch_index)
        if isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0:
            _invalid("src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self.cache_key}, src_layer_range={self.src_layer_range}, "
                f"dst_layer_range={self.dst_layer_range}, src_batch_index={self.src_batch_index})")


class TransferConfig:
    """A destination given by raw peer addresses: accepted as a value, refused by
    ``transfer_cache_async`` (kvflow reaches a peer's memory only through its registered caches)."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int], src_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        _uint64("dst_cluster_id", dst_cluster_id)
        _check_type("dst_addrs", dst_addrs, (list, tuple), int, allow_none=False)
        _check_layer_range("src_layer_range", src_layer_range)
        _uint32("src_batch_index", src_batch_index)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self.dst_cluster_id}, dst_addrs={self.dst_addrs}, "
                f"src_layer_range={self.src_layer_range}, src_batch_index={self.src_batch_index})")


class CacheTask:
    """A running ``transfer_cache_async``: ``synchronize`` and ``get_results`` wait (at most
    ``timeout_in_millis``, else until it ends); a wait that times out leaves the transfer running."""

    def __init__(self, task: _sync.CacheTask | None, slots: list[int | None],
                 early: dict[int, LLMStatusCode]) -> None:
        self._task = task
        self._slots = slots  # per config: its index in the kvflow task, or None (failed before it started)
        self._early = early  # per config index: the status it failed with before the task started

    def _wait(self, timeout_in_millis: int | None) -> bool:
        """Whether the task has ended (waiting at most ``timeout_in_millis``)."""
        if timeout_in_millis is not None:
            _uint32("timeout_in_millis", timeout_in_millis)
        if self._task is None or self._task.done():
            return True
        self._task.synchronize(timeout_in_millis)
        return self._task.done()

    def _results(self) -> list[LLMStatusCode | None]:
        got = self._task.get_results() if self._task is not None else []
        out: list[LLMStatusCode | None] = []
        for i, slot in enumerate(self._slots):
            if slot is None:
                out.append(self._early[i])
            else:
                r = got[slot]
                out.append(None if r is None else _code(r))
        return out

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """LLM_SUCCESS, the first failed config's status, or LLM_TIMEOUT if the task still runs."""
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results():
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        err = self._task.exception() if self._task is not None else None
        assert err is None or isinstance(err, LLMException)  # a layer-wise task records LLMExceptions only
        return _code(err.status_code) if err is not None else LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per config (None: none of its layers was sent); all LLM_TIMEOUT if the task
        still runs after the wait."""
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._slots)
        return self._results()

    @property
    def kvflow_task(self) -> _sync.CacheTask | None:
        """The underlying :class:`kvflow.sync.CacheTask` (progress, ``cancel()``); kvflow extension."""
        return self._task


# ---------------------------------------------------------------------- layer ranges
def _inclusive(rng: range) -> tuple[int, int]:
    return rng.start, rng.stop - 1


def _check_per_layer(what: str, n: Any, num_tensors: int) -> int:
    _uint32("tensor_num_per_layer", n)
    if n <= 0:
        _invalid(f"[{what}] param check failed, tensor_num_per_layer ({n}) is invalid, should [1, {num_tensors}]")
    return int(n)


def _pull_ext(src: range | None, dst: range | None, n: int, local_tensors: int) -> KvCacheExtParam | None:
    """Layers of a pull. None for both: every layer. One None: dst takes all local layers; src
    starts at layer 0 with dst's length (as the original's native side reads it)."""
    for name, rng in (("src_layer_range", src), ("dst_layer_range", dst)):
        if rng is not None:
            _check_type(name, rng, range)
            if rng.step != 1:
                _invalid(f"param check failed, {name} step must be 1.")
            if len(rng) and rng.start < 0:
                _invalid(f"{name} is invalid, the start value:{rng.start} is < 0")
    if src is None and dst is None:
        return None if n == _TENSORS_PER_LAYER else KvCacheExtParam(tensor_num_per_layer=n)
    if dst is None:
        dst = range(0, local_tensors // n)
    if src is None:
        src = range(0, len(dst))
    if not len(src) or not len(dst):
        _invalid("layer ranges must not be empty")
    return KvCacheExtParam(_inclusive(src), _inclusive(dst), n)


def _push_ext(src: range | None, dst: range | None, n: int, src_tensors: int) -> KvCacheExtParam:
    """Layers of a push: None is every layer of the source cache, on both sides (the original's default)."""
    _check_layer_range("src_layer_range", src)
    _check_layer_range("dst_layer_range", dst)
    layers = src_tensors // n
    src = range(0, layers) if src is None else src
    dst = range(0, layers) if dst is None else dst
    if len(src) != len(dst):
        _invalid("src_layer_range size should be equal to size of dst_layer_range size.")
    if not len(src):
        _invalid(f"the source cache has no whole layer of {n} tensors")
    return KvCacheExtParam(_inclusive(src), _inclusive(dst), n)


def _blocks(name: str, value: Any) -> list[int]:
    _check_type(name, value, (list, tuple), int)
    return list(value) if value is not None else []
