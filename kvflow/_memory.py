"""Registered memory: turning user addresses into regions, and checking peer requests against them."""

from __future__ import annotations

import abc
import asyncio
import bisect
import ctypes
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ._status import LLMException, LLMKvCacheNotExist, LLMParamInvalid
from ._types import Cache, CacheDesc, DataType, Placement


@dataclass
class Region:
    """One registered tensor: ``nbytes`` at ``addr``; ``view`` is a writable byte view for host memory."""

    addr: int
    nbytes: int
    placement: Placement
    view: memoryview | None
    owner: object = None  # keeps the user's object alive while registered


def _host_view(addr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


# The element type each DataType names, spelled as numpy's ``dtype.name`` and torch's ``str(dtype)``
# (without "torch."). numpy has no bfloat16: an array matches DT_BF16 only through a dtype named
# "bfloat16" (ml_dtypes), or as untyped bytes.
ELEMENT_NAMES: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT32: "int32",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT32: "uint32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT64: "uint64",
    DataType.DT_DOUBLE: "float64",
    DataType.DT_BOOL: "bool",
    DataType.DT_BF16: "bfloat16",
}
# Untyped bytes, accepted under any data_type: uint8 (numpy, torch, memoryview 'B'), and char
# (memoryview 'c', numpy 'S1'), which _array_region calls uint8. int8 ('b') is a type of its own:
# it matches DT_INT8 only.
UNTYPED = "uint8"
_CHAR = np.dtype("S1")


def _dtype_name(dtype: Any) -> str:
    """``float16`` for numpy's dtype('float16') and for torch.float16."""
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).rsplit(".", 1)[-1]


def _check_dtype(name: str, data_type: DataType | None, index: int) -> None:
    """LLMParamInvalid unless elements called ``name`` can be addressed as ``data_type``."""
    if data_type is None or name == UNTYPED:
        return
    want = ELEMENT_NAMES[DataType(data_type)]
    if name != want:
        raise LLMParamInvalid(
            f"addrs[{index}]: dtype {name} does not match data_type {DataType(data_type).name} ({want}); "
            "register memory of that type, or untyped bytes (uint8)"
        )


def resolve_region(obj: Any, nbytes: int, placement: Placement, index: int,
                   data_type: DataType | None = None) -> Region:
    """Turn one entry of ``addrs`` (int, buffer, DLPack or ``data_ptr()`` object) into a Region.

    Memory that carries a layout must be C-contiguous, hold at least ``nbytes`` and, unless it is
    untyped bytes, have the element type of ``data_type`` (None skips that check). An int address
    carries no layout: the caller vouches for it, as in LLM-DataDist.
    """
    if isinstance(obj, bool):
        raise LLMParamInvalid(f"addrs[{index}]: expected an address or a buffer, got a bool")
    if isinstance(obj, (int, np.integer)):
        addr = int(obj)
        if addr <= 0 or addr + nbytes > 1 << 64:
            raise LLMParamInvalid(f"addrs[{index}]: address {addr:#x} is not a valid non-zero address")
        view = _host_view(addr, nbytes) if placement == Placement.HOST else None
        return Region(addr, nbytes, placement, view)
    if isinstance(obj, np.ndarray):
        return _array_region(obj, obj, nbytes, placement, index, data_type)
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and not isinstance(obj, (bytes, bytearray, memoryview)):
        return _tensor_region(obj, data_ptr, nbytes, placement, index, data_type)
    dlpack_error = None
    if callable(getattr(obj, "__dlpack__", None)):
        try:
            arr = np.from_dlpack(obj)
        except Exception as exc:  # device memory or a dtype numpy lacks: try the buffer protocol next
            dlpack_error = f"{type(exc).__name__}: {exc}"
        else:
            return _array_region(arr, obj, nbytes, placement, index, data_type)
    try:
        mv = memoryview(obj)
    except TypeError:
        why = f" (numpy cannot read its DLPack: {dlpack_error})" if dlpack_error else ""
        raise LLMParamInvalid(
            f"addrs[{index}]: expected an int address, a buffer, a DLPack object or an object with "
            f"data_ptr(), got {type(obj).__name__}{why}"
        ) from None
    try:
        arr = np.asarray(mv)  # no copy: numpy reads the buffer's format, shape and strides
    except Exception:
        raise LLMParamInvalid(
            f"addrs[{index}]: buffer format {mv.format!r} is not an element type kvflow knows"
        ) from None
    return _array_region(arr, obj, nbytes, placement, index, data_type)


def _array_region(arr: np.ndarray, owner: Any, nbytes: int, placement: Placement, index: int,
                  data_type: DataType | None) -> Region:
    """Region of host memory described by ``arr`` (the user's array, or a view of ``owner``)."""
    if not arr.flags.writeable:
        raise LLMParamInvalid(f"addrs[{index}]: buffer is read-only")
    if not arr.flags.c_contiguous:
        raise LLMParamInvalid(
            f"addrs[{index}]: buffer is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "a pull would write bytes outside the view"
        )
    if arr.dtype.itemsize > 1 and not arr.dtype.isnative:
        raise LLMParamInvalid(f"addrs[{index}]: dtype {arr.dtype.str} is not in native byte order")
    _check_dtype(UNTYPED if arr.dtype == _CHAR else arr.dtype.name, data_type, index)
    if arr.nbytes < nbytes:
        raise LLMParamInvalid(f"addrs[{index}]: buffer holds {arr.nbytes} bytes, a tensor needs {nbytes}")
    if placement != Placement.HOST:
        raise LLMParamInvalid(f"addrs[{index}]: a host buffer registered with placement DEVICE")
    if nbytes == 0:
        raise LLMParamInvalid(f"addrs[{index}]: empty tensor")
    mv = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # C-contiguous: a view, not a copy
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return Region(addr, nbytes, placement, mv[:nbytes], owner=owner)


def _tensor_region(obj: Any, data_ptr: Any, nbytes: int, placement: Placement, index: int,
                   data_type: DataType | None) -> Region:
    """Region of a torch-like tensor; the layout checks use what it exposes (``is_contiguous()``,
    ``dtype``, ``numel()`` and ``element_size()``), and a check it gives no answer to is skipped."""
    layout = str(getattr(obj, "layout", ""))
    if layout.startswith("torch.") and layout != "torch.strided":
        raise LLMParamInvalid(f"addrs[{index}]: tensor layout {layout} is not one block of memory")
    is_contiguous = getattr(obj, "is_contiguous", None)
    if callable(is_contiguous) and not is_contiguous():
        shape = tuple(getattr(obj, "shape", ()))
        stride = obj.stride() if callable(getattr(obj, "stride", None)) else "?"
        raise LLMParamInvalid(
            f"addrs[{index}]: tensor is not contiguous (shape {shape}, stride {stride}); "
            "a pull would write bytes outside the view"
        )
    dtype = getattr(obj, "dtype", None)
    if dtype is not None:
        _check_dtype(_dtype_name(dtype), data_type, index)
    size = _object_nbytes(obj)
    if size is not None and size < nbytes:
        raise LLMParamInvalid(f"addrs[{index}]: object holds {size} bytes, a tensor needs {nbytes}")
    on_device = getattr(getattr(obj, "device", None), "type", "cpu") != "cpu"
    if on_device and placement != Placement.DEVICE:
        raise LLMParamInvalid(f"addrs[{index}]: device tensor registered with placement HOST")
    try:
        addr = int(data_ptr())
    except Exception as exc:
        raise LLMParamInvalid(f"addrs[{index}]: data_ptr() failed: {exc}") from None
    if addr <= 0:
        raise LLMParamInvalid(f"addrs[{index}]: data_ptr() is 0")
    view = None if on_device else _host_view(addr, nbytes)
    return Region(addr, nbytes, placement, view, owner=obj)


def _object_nbytes(obj: Any) -> int | None:
    try:
        return int(obj.numel()) * int(obj.element_size())
    except Exception:  # not torch-like: the caller vouches for the size, as with an int address
        return None


class CacheUser(abc.ABC):
    """A transport's object that reads or writes registered caches on a peer's behalf, pinning each
    (``LocalCache.pin(self)``) while it does. Past an unregister's deadline the core calls
    :meth:`revoke` on every user that still pins the cache."""

    @abc.abstractmethod
    def revoke(self, cache: LocalCache, exc: LLMException) -> None:
        """Stop touching ``cache`` at once (unpinning it); fail the peer's requests on it with ``exc``."""


SMALL_RUNS = 8  # run lists up to this long are handled with Python ints, longer ones with numpy


@dataclass
class LocalCache:
    """A cache registered here, with its regions and the count of peer operations using it."""

    cache: Cache
    regions: list[Region]
    cache_id: int = field(init=False)
    desc: CacheDesc = field(init=False)
    addrs: np.ndarray = field(init=False)  # start address of each tensor, in tensor order
    starts: np.ndarray = field(init=False)
    sizes: np.ndarray = field(init=False)
    order: np.ndarray = field(init=False)
    inflight: int = 0
    unregistering: asyncio.Future[None] | None = None  # the unregister call under way; done when it ends
    idle: asyncio.Event | None = None
    pins: dict[CacheUser | None, int] = field(default_factory=dict)  # who holds the operations (None: us)
    descs: dict[str, list[bytes | None]] = field(default_factory=dict)  # per transport, for peers

    def __post_init__(self) -> None:
        self.cache_id = self.cache.cache_id  # attributes, not properties: read on every transfer
        self.desc = self.cache.cache_desc
        addrs = np.array([r.addr for r in self.regions], dtype=np.uint64)
        self.addrs = addrs
        self.addrs.flags.writeable = False
        self.order = np.argsort(addrs, kind="stable")
        self.starts = addrs[self.order]
        self.sizes = np.array([r.nbytes for r in self.regions], dtype=np.uint64)[self.order]
        self._starts_list: list[int] = self.starts.tolist()
        self._sizes_list: list[int] = self.sizes.tolist()
        self._order_list: list[int] = self.order.tolist()
        self._addr_list: list[int] = addrs.tolist()
        self._views: list[Any] = [r.view for r in self.regions]  # None for device memory
        self._closing = False
        #: ``closing`` where C reads it (a tcp receive job that takes a peer's writes on its own)
        self.closing_flag = np.zeros(1, np.int32)

    @property
    def closing(self) -> bool:
        """Being unregistered: new peer requests on it are refused."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value
        self.closing_flag[0] = value

    @property
    def addr_list(self) -> list[int]:
        """``addrs`` as Python ints (do not modify), for planning tiny transfers without numpy."""
        return self._addr_list

    def locate(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Index of the region holding each run; raises LLMParamInvalid if any run leaves its region."""
        if addrs.size == 0:
            raise LLMParamInvalid("empty run list")
        pos = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        ok = pos >= 0
        posc = np.where(ok, pos, 0)
        start = self.starts[posc]
        size = self.sizes[posc]
        off = addrs - np.where(ok, start, addrs)
        ok &= (lens > 0) & (lens <= size) & (off <= size - np.minimum(lens, size))
        if not bool(ok.all()):
            bad = int(np.argmin(ok))
            raise LLMParamInvalid(
                f"run {bad} ({int(addrs[bad]):#x}+{int(lens[bad])}) is outside cache {self.cache_id}"
            )
        return self.order[posc]

    def _locate_one(self, addr: int, length: int) -> int:
        starts = self._starts_list
        pos = bisect.bisect_right(starts, addr) - 1
        if pos < 0 or length <= 0 or addr + length > starts[pos] + self._sizes_list[pos]:
            raise LLMParamInvalid(f"run {addr:#x}+{length} is outside cache {self.cache_id}")
        return self._order_list[pos]

    def check_host(self) -> None:
        """LLMParamInvalid unless the cache is host memory (which a socket can read and write)."""
        if self.regions[0].view is None:
            raise LLMParamInvalid(f"cache {self.cache_id} is device memory; this transport needs host memory")

    def views(self, addrs: np.ndarray, lens: np.ndarray, tensors: np.ndarray | None = None) -> list[memoryview]:
        """Byte views of the given runs. Without ``tensors`` (each run's tensor index, as planned
        locally) every run is first checked to lie inside a registered tensor."""
        if addrs.size <= SMALL_RUNS:
            return self.views_small(addrs.tolist(), lens.tolist(), None if tensors is None else tensors.tolist())
        idx = self.locate(addrs, lens) if tensors is None else tensors
        self.check_host()
        starts = addrs - self.addrs[idx]  # offsets inside each run's tensor, computed at once
        ends = (starts + lens).tolist()
        starts = starts.tolist()
        views = self._views
        if len(views) == 1:
            v = views[0]
            return [v[a:b] for a, b in zip(starts, ends)]
        return [views[i][a:b] for i, a, b in zip(idx.tolist(), starts, ends)]

    def views_small(self, addrs: list[int], lens: list[int], tensors: list[int] | None = None) -> list[memoryview]:
        """``views`` of a few runs given as Python ints (no numpy: cheaper below a dozen runs)."""
        if not addrs:
            raise LLMParamInvalid("empty run list")
        if tensors is None:
            tensors = [self._locate_one(a, n) for a, n in zip(addrs, lens)]
        self.check_host()
        bases, views = self._addr_list, self._views
        return [views[t][a - bases[t] : a - bases[t] + n] for t, a, n in zip(tensors, addrs, lens)]

    def pin(self, owner: CacheUser | None = None) -> None:
        """Count an operation that reads or writes this cache's memory."""
        self.inflight += 1
        self.pins[owner] = self.pins.get(owner, 0) + 1

    def unpin(self, owner: CacheUser | None = None) -> None:
        self.inflight -= 1
        left = self.pins[owner] - 1
        if left:
            self.pins[owner] = left
        else:
            del self.pins[owner]
        if self.inflight == 0 and self.idle is not None:
            self.idle.set()


class Registry:
    """The caches registered on one LlmDataDist, by id."""

    def __init__(self) -> None:
        self._caches: dict[int, LocalCache] = {}
        self._next_id = 1

    def add(self, desc: CacheDesc, addrs: Sequence[Any]) -> LocalCache:
        desc.validate()
        if isinstance(addrs, (bytes, bytearray, memoryview, np.ndarray)) or not hasattr(addrs, "__len__"):
            raise LLMParamInvalid("addrs must be a sequence with one entry per tensor")
        if len(addrs) != desc.num_tensors:
            raise LLMParamInvalid(f"addrs has {len(addrs)} entries, num_tensors is {desc.num_tensors}")
        nbytes = desc.tensor_bytes
        if desc.num_blocks and nbytes % desc.num_blocks:
            raise LLMParamInvalid("tensor bytes are not a multiple of shape[0]")
        placement, data_type = Placement(desc.placement), DataType(desc.data_type)
        regions = [resolve_region(a, nbytes, placement, i, data_type) for i, a in enumerate(addrs)]
        cache = Cache(self._next_id, tuple(r.addr for r in regions), desc)
        self._next_id += 1
        local = LocalCache(cache, regions)
        self._caches[cache.cache_id] = local
        return local

    def get(self, cache_id: int) -> LocalCache:
        """The cache, or LLMKvCacheNotExist (also while it is being unregistered)."""
        local = self._caches.get(cache_id)
        if local is None or local.closing:
            raise LLMKvCacheNotExist(f"cache {cache_id} is not registered here")
        return local

    def lookup(self, cache_id: int) -> LocalCache | None:
        """The cache if it is registered and not being unregistered, else None."""
        local = self._caches.get(cache_id)
        return None if local is None or local.closing else local

    def get_any(self, cache_id: int) -> LocalCache | None:
        """The cache, also while it is being unregistered (None if unknown)."""
        return self._caches.get(cache_id)

    def pop(self, cache_id: int) -> LocalCache | None:
        return self._caches.pop(cache_id, None)

    def __iter__(self) -> Iterator[LocalCache]:
        return iter(list(self._caches.values()))

    def __len__(self) -> int:
        return len(self._caches)
