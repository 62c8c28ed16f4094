"""Planning: layout, layer ranges and block lists -> coalesced runs, as arrays.

Block ``b`` of tensor ``t`` starts at ``addrs[t] + b * stride``. Layer ``l`` is tensors
``[l*N, (l+1)*N)``. Block pairs that advance together on both sides are merged into one run;
every index and size is checked here, before a byte moves.
"""

from __future__ import annotations

import operator
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ._status import LLMParamInvalid
from ._types import BlockList, CacheDesc, KvCacheExtParam, LayerRange
from .transport import RunBatch

if TYPE_CHECKING:
    from ._memory import LocalCache
    from .transport import RemoteCache


def layer_tensors(rng: LayerRange, num_tensors: int, per_layer: int, what: str) -> np.ndarray:
    """Tensor indices of an inclusive ``(first, last)`` layer range or a ``range``; (-1, -1) = all."""
    if rng == (-1, -1):
        return _all_tensors(num_tensors)
    if isinstance(rng, range):
        if rng.step != 1 or len(rng) == 0:
            raise LLMParamInvalid(f"{what}: a range must be non-empty with step 1, got {rng!r}")
        first, last = rng.start, rng.stop - 1
    else:
        try:
            first, last = (int(v) for v in rng)
        except (TypeError, ValueError):
            raise LLMParamInvalid(f"{what}: expected (first, last) or a range, got {rng!r}") from None
        if first < 0 or last < 0:
            if (first, last) != (-1, -1):
                raise LLMParamInvalid(f"{what}: {rng!r}: use (-1, -1) for all layers")
            return np.arange(num_tensors, dtype=np.int64)
    if num_tensors % per_layer:
        raise LLMParamInvalid(
            f"{what}: tensor_num_per_layer={per_layer} does not divide num_tensors={num_tensors}"
        )
    layers = num_tensors // per_layer
    if not 0 <= first <= last < layers:
        raise LLMParamInvalid(f"{what}: layers {first}..{last} are outside 0..{layers - 1}")
    return np.arange(first * per_layer, (last + 1) * per_layer, dtype=np.int64)


@lru_cache(maxsize=256)
def _all_tensors(num_tensors: int) -> np.ndarray:
    out = np.arange(num_tensors, dtype=np.int64)
    out.flags.writeable = False
    return out


def _ext(ext: KvCacheExtParam | None) -> tuple[KvCacheExtParam, int]:
    """``ext`` (default: all layers) and its checked ``tensor_num_per_layer``."""
    ext = ext or KvCacheExtParam()
    if not isinstance(ext, KvCacheExtParam):
        raise LLMParamInvalid(f"ext_param must be a KvCacheExtParam, got {type(ext).__name__}")
    n = ext.tensor_num_per_layer
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise LLMParamInvalid(f"tensor_num_per_layer must be a positive int, got {n!r}")
    return ext, int(n)


def tensor_pairs(ext: KvCacheExtParam | None, src: CacheDesc, dst: CacheDesc) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination tensor indices selected by ``ext``, of equal length."""
    ext, n = _ext(ext)
    s = layer_tensors(ext.src_layer_range, src.num_tensors, n, "src_layer_range")
    d = layer_tensors(ext.dst_layer_range, dst.num_tensors, n, "dst_layer_range")
    if s.size != d.size:
        raise LLMParamInvalid(f"layer ranges select {s.size} source and {d.size} destination tensors")
    return s, d


def side_tensors(ext: KvCacheExtParam | None, desc: CacheDesc, is_src: bool) -> np.ndarray:
    """One side's tensor indices selected by ``ext`` (the checks that need only that cache)."""
    ext, n = _ext(ext)
    rng = ext.src_layer_range if is_src else ext.dst_layer_range
    return layer_tensors(rng, desc.num_tensors, n, "src_layer_range" if is_src else "dst_layer_range")


def block_list(blocks: Any, num_blocks: int, what: str) -> np.ndarray:
    """A block list as int64, each index checked against ``num_blocks``."""
    if isinstance(blocks, (str, bytes)):
        raise LLMParamInvalid(f"{what} must be a sequence of block indices")
    try:
        arr = np.asarray(blocks)
    except Exception:
        raise LLMParamInvalid(f"{what} must be a sequence of block indices") from None
    if arr.ndim != 1 or arr.size == 0:
        raise LLMParamInvalid(f"{what} must be a non-empty 1-D list of block indices")
    if arr.dtype == object or arr.dtype.kind not in "iu":
        raise LLMParamInvalid(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 62:
        raise LLMParamInvalid(f"{what}: index {int(arr.max())} is out of range")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise LLMParamInvalid(f"{what}: block {bad} is outside 0..{num_blocks - 1}")
    return arr


def has_duplicates(blocks: np.ndarray, num_blocks: int) -> bool:
    """Whether a checked block list (``block_list``) names a block twice: a count per block when the
    cache is not much larger than the list (tens of µs for 16k blocks), else a sort. ``np.unique``
    costs 2 ms for 16k blocks with numpy 2's hash path: too long for one event loop callback."""
    if blocks.size < 2:
        return False
    if num_blocks <= 64 * blocks.size + 4096:
        return bool(np.bincount(blocks, minlength=num_blocks).max() > 1)
    s = np.sort(blocks)
    return bool((s[1:] == s[:-1]).any())


def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pairs that advance by one on both sides: (src starts, dst starts, block counts)."""
    if src.size == 1:
        return src, dst, np.ones(1, dtype=np.int64)
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


_U64 = np.dtype(np.uint64)
SMALL = 16  # block lists up to this long are planned in plain Python: cheaper than numpy calls


def small_block_list(blocks: Any, num_blocks: int, what: str) -> list[int] | None:
    """A short block list as checked Python ints, or None when numpy should take it."""
    if not isinstance(blocks, (list, tuple)) or not 0 < len(blocks) <= SMALL:
        return None
    out = []
    for b in blocks:
        if type(b) is not int:  # exactly int is the fast case; bool, numpy ints... below
            if isinstance(b, bool):
                raise LLMParamInvalid(f"{what} must hold integers, got {b!r}")
            try:
                b = operator.index(b)
            except TypeError:
                raise LLMParamInvalid(f"{what} must hold integers, got {b!r}") from None
        if not 0 <= b < num_blocks:
            raise LLMParamInvalid(f"{what}: block {b} is outside 0..{num_blocks - 1}")
        out.append(b)
    return out


def coalesce_small(src: list[int], dst: list[int], stride: int) -> tuple[list[int], list[int], list[int]]:
    """``coalesce`` for short Python lists, in bytes: (source offsets, destination offsets, run lengths)."""
    if len(src) == 1:
        return [src[0] * stride], [dst[0] * stride], [stride]
    s0, d0, cnt = [src[0]], [dst[0]], [1]
    for s, d in zip(src[1:], dst[1:]):
        if s == s0[-1] + cnt[-1] and d == d0[-1] + cnt[-1]:
            cnt[-1] += 1
        else:
            s0.append(s)
            d0.append(d)
            cnt.append(1)
    return [b * stride for b in s0], [b * stride for b in d0], [c * stride for c in cnt]


class Plan:
    """Runs between a source and a destination cache, as one (5, n) uint64 table in the row order
    of :class:`~kvflow.transport.RunBatch`: local address, remote address, length, local tensor,
    remote tensor (``local_is_src`` says which side is local)."""

    __slots__ = ("local_is_src", "table")

    def __init__(self, table: np.ndarray, local_is_src: bool) -> None:
        self.table = table
        self.local_is_src = local_is_src

    @classmethod
    def build(cls, src_addrs: np.ndarray, src_stride: int, dst_addrs: np.ndarray, dst_stride: int,
              src_t: np.ndarray, dst_t: np.ndarray, src_start: np.ndarray, dst_start: np.ndarray,
              run_bytes: np.ndarray, local_is_src: bool) -> Plan:
        """Every selected tensor pair times every run (vectorised)."""
        nt, nr = src_t.size, src_start.size
        table = np.empty((5, nt, nr), dtype=np.uint64)
        s, d = (0, 1) if local_is_src else (1, 0)
        table[s] = src_addrs[src_t].astype(np.uint64)[:, None] + src_start.astype(np.uint64) * np.uint64(src_stride)
        table[d] = dst_addrs[dst_t].astype(np.uint64)[:, None] + dst_start.astype(np.uint64) * np.uint64(dst_stride)
        table[2] = run_bytes.astype(np.uint64)
        table[3 + s] = src_t.astype(np.uint64)[:, None]
        table[3 + d] = dst_t.astype(np.uint64)[:, None]
        return cls(table.reshape(5, nt * nr), local_is_src)

    @classmethod
    def small(cls, src_addrs: list[int], src_offs: list[int], dst_addrs: list[int], dst_offs: list[int],
              src_t: list[int], dst_t: list[int], run_bytes: list[int], local_is_src: bool) -> Plan:
        """The same runs as ``build``, computed in plain Python for short lists: ``*_addrs`` are the
        tensors' start addresses, ``*_offs`` each run's byte offset inside a tensor."""
        if len(run_bytes) == 1:
            st, dt = src_t, dst_t
            if len(src_t) == 1:  # a single run: the common tiny transfer
                sa, da = [src_addrs[st[0]] + src_offs[0]], [dst_addrs[dt[0]] + dst_offs[0]]
            else:
                sa = [src_addrs[t] + src_offs[0] for t in src_t]
                da = [dst_addrs[t] + dst_offs[0] for t in dst_t]
        else:
            sa = [src_addrs[t] + o for t in src_t for o in src_offs]
            da = [dst_addrs[t] + o for t in dst_t for o in dst_offs]
            st = [t for t in src_t for _ in run_bytes]
            dt = [t for t in dst_t for _ in run_bytes]
        ln = run_bytes * len(src_t)
        flat = sa + da + ln + st + dt if local_is_src else da + sa + ln + dt + st
        return cls(np.fromiter(flat, _U64, len(flat)).reshape(5, -1), local_is_src)  # fromiter: the cheapest

    def batch(self, local: LocalCache, remote: RemoteCache) -> RunBatch:
        """These runs as a transport's batch between ``local`` and ``remote``."""
        return RunBatch.of_table(self.table, local, remote)

    @property
    def src_addr(self) -> np.ndarray:
        return self.table[0 if self.local_is_src else 1]

    @property
    def dst_addr(self) -> np.ndarray:
        return self.table[1 if self.local_is_src else 0]

    @property
    def length(self) -> np.ndarray:
        return self.table[2]

    @property
    def src_tensor(self) -> np.ndarray:
        return self.table[3 if self.local_is_src else 4].view(np.int64)

    @property
    def dst_tensor(self) -> np.ndarray:
        return self.table[4 if self.local_is_src else 3].view(np.int64)


def _pairs(ext: KvCacheExtParam | None, src: CacheDesc, dst: CacheDesc) -> tuple[np.ndarray, np.ndarray]:
    """``tensor_pairs``, with the common case (no ext_param, same tensor count) first."""
    if ext is None and src.num_tensors == dst.num_tensors:
        t = _all_tensors(src.num_tensors)
        return t, t
    return tensor_pairs(ext, src, dst)


def plan_blocks(src: CacheDesc, src_addrs: np.ndarray, dst: CacheDesc, dst_addrs: np.ndarray,
                src_blocks: BlockList, dst_blocks: BlockList, ext: KvCacheExtParam | None,
                local_is_src: bool = True) -> Plan:
    """Runs for a block-list transfer; every block and layer is checked."""
    s_t, d_t = _pairs(ext, src, dst)
    ss = small_block_list(src_blocks, src.num_blocks, "src_blocks")
    ds = small_block_list(dst_blocks, dst.num_blocks, "dst_blocks")
    if ss is not None and ds is not None:
        if len(ss) != len(ds):
            raise LLMParamInvalid(f"src_blocks has {len(ss)} entries, dst_blocks has {len(ds)}")
        if src.stride != dst.stride:
            raise LLMParamInvalid(f"block sizes differ: source {src.stride} bytes, destination {dst.stride}")
        if len(ds) > 1 and len(set(ds)) != len(ds):
            raise LLMParamInvalid("dst_blocks names a block more than once")
        stride = src.stride
        so, do, nb = coalesce_small(ss, ds, stride)
        if s_t.size * len(so) <= SMALL:
            return Plan.small(src_addrs.tolist(), so, dst_addrs.tolist(), do, s_t.tolist(), d_t.tolist(), nb,
                              local_is_src)
        return Plan.build(src_addrs, 1, dst_addrs, 1, s_t, d_t, np.array(so, dtype=np.int64),
                          np.array(do, dtype=np.int64), np.array(nb, dtype=np.int64), local_is_src)
    sb = block_list(src_blocks, src.num_blocks, "src_blocks")
    db = block_list(dst_blocks, dst.num_blocks, "dst_blocks")
    if sb.size != db.size:
        raise LLMParamInvalid(f"src_blocks has {sb.size} entries, dst_blocks has {db.size}")
    if src.stride != dst.stride:
        raise LLMParamInvalid(f"block sizes differ: source {src.stride} bytes, destination {dst.stride}")
    if has_duplicates(db, dst.num_blocks):
        raise LLMParamInvalid("dst_blocks names a block more than once")
    s0, d0, cnt = coalesce(sb, db)
    return Plan.build(src_addrs, src.stride, dst_addrs, dst.stride, s_t, d_t, s0, d0, cnt * src.stride, local_is_src)


def plan_cache(src: CacheDesc, src_addrs: np.ndarray, src_batch: int, dst: CacheDesc, dst_addrs: np.ndarray,
               dst_batch: int, size: int, ext: KvCacheExtParam | None, local_is_src: bool = True) -> Plan:
    """Runs for a whole-slot transfer: ``size`` bytes per tensor (-1 = the whole batch slot)."""
    s_t, d_t = _pairs(ext, src, dst)
    for what, b, desc in (("source batch_index", src_batch, src), ("destination batch_index", dst_batch, dst)):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < desc.num_blocks:
            raise LLMParamInvalid(f"{what} {b!r} is outside 0..{desc.num_blocks - 1}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise LLMParamInvalid(f"size must be an int, got {size!r}")
    if size == -1:
        if src.stride != dst.stride:
            raise LLMParamInvalid(f"slot sizes differ ({src.stride} vs {dst.stride} bytes): pass size")
        size = src.stride
    if not 0 < size <= min(src.stride, dst.stride):
        raise LLMParamInvalid(f"size {size} must be -1 or in 1..{min(src.stride, dst.stride)} (bytes per tensor slot)")
    if s_t.size <= SMALL:
        return Plan.small(src_addrs.tolist(), [int(src_batch) * src.stride], dst_addrs.tolist(),
                          [int(dst_batch) * dst.stride], s_t.tolist(), d_t.tolist(), [int(size)], local_is_src)
    one = np.ones(1, dtype=np.int64)
    return Plan.build(src_addrs, src.stride, dst_addrs, dst.stride, s_t, d_t, one * int(src_batch),
                      one * int(dst_batch), one * int(size), local_is_src)
