"""Planning: layout, layer ranges and block lists -> coalesced runs, as arrays.

Block ``b`` of tensor ``t`` starts at ``addrs[t] + b * stride``. Layer ``l`` is tensors
``[l*N, (l+1)*N)``. Block pairs that advance together on both sides are merged into one run;
every index and size is checked here, before a byte moves.

Large requests never hold the caller's event loop for long (issue 13): planning is written as
*steps*, a generator that yields between pieces of at most about 0.1 ms of work (block lists are
converted ``STEP`` entries at a time) and may yield a ``(function, argument)`` pair for work that
releases the GIL (a sort), which the event loop's driver runs on a worker thread. A plan of more
than ``PIECE_RUNS`` runs is kept compact (one address per tensor, one offset per run) and turned
into run tables ``PIECE_RUNS`` columns at a time, as the engine moves it: memory stays
O(tensors + blocks), not O(tensors x blocks).
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Generator, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Union

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


@lru_cache(maxsize=256)
def _tensor_list(num_tensors: int) -> tuple[int, ...]:
    return tuple(range(num_tensors))


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


#: Entries of a Python block list converted, or blocks handled, per step (about 0.1 ms; 4096 took 0.24 ms,
#: the whole of a 100k-entry list 2-4 ms).
STEP = 2048
#: Block lists of pulls and pushes longer than this are checked and planned in steps that the event loop
#: interleaves with its other work (at 2048, a 2048-block shm pull's longest callback measured 0.46-0.62
#: ms of CPU against 0.27-0.37 ms at 1024: docs/benchmarks.md).
DEFER_BLOCKS = 1024
#: ``transfer_cache_async`` checks block lists of up to this many entries in the call itself; longer
#: ones are checked by its task, in steps (docs/layerwise.md).
CALL_CHECK_BLOCKS = 2048
#: A plan of more runs than this is kept compact and moved in batches of at most this many runs (at 16384
#: the step that makes and hands over a batch took up to 0.8-1 ms of the loop: docs/decisions.md).
PIECE_RUNS = 8192

#: What planning steps yield: None (a point where the loop may run other callbacks), or a function and
#: its argument to run where the GIL is not needed (the driver runs it on a worker thread).
Step = Union[None, tuple[Callable[[Any], Any], Any]]
Steps = Generator[Step, Any, Any]


def run_steps(steps: Steps) -> Any:
    """Drive planning steps on this thread at once; their result."""
    try:
        item = next(steps)
        while True:
            item = steps.send(None if item is None else item[0](item[1]))
    except StopIteration as stop:
        return stop.value


#: How long the event loop's driver runs planning steps before it lets other callbacks run.
SLICE_S = 250e-6


async def run_steps_async(steps: Steps) -> Any:
    """Drive planning steps on the running event loop: other callbacks run between slices of at most
    about ``SLICE_S`` (a slice ends before a step that would take it past that, if the step costs what
    the one before it did), and work that releases the GIL runs on the loop's default executor; their
    result, returned in a callback of its own, so that what the caller does next does not lengthen the
    last slice."""
    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    last = 0.0  # how long the last step took: the next is taken to cost as much
    try:
        item = next(steps)
        while True:
            result = None
            if item is not None:
                result = await loop.run_in_executor(None, item[0], item[1])
                t = time.perf_counter()
            elif time.perf_counter() - t + last > SLICE_S:  # the next step would end the slice past SLICE_S
                await asyncio.sleep(0)
                t = time.perf_counter()
            s = time.perf_counter()
            item = steps.send(result)
            last = time.perf_counter() - s
    except StopIteration as stop:
        value = stop.value
    await asyncio.sleep(0)
    return value


def block_list_steps(blocks: Any, num_blocks: int, what: str) -> Steps:
    """``block_list`` in steps: a long Python list is converted ``STEP`` entries at a time."""
    if not isinstance(blocks, (list, tuple)) or len(blocks) <= STEP:
        return block_list(blocks, num_blocks, what)
    out = np.empty(len(blocks), dtype=np.int64)
    for i in range(0, len(blocks), STEP):
        yield None
        out[i:i + STEP] = block_list(blocks[i:i + STEP], num_blocks, what)  # each part checked in full
    return out


def duplicates_steps(blocks: np.ndarray, num_blocks: int) -> Steps:
    """``has_duplicates`` in steps: ``STEP`` blocks at a time, each written into a table of the cache's
    blocks with its position (a block seen twice finds another position there, or loses its own);
    the sort of a list much smaller than its cache runs on a thread."""
    yield None
    n = blocks.size
    if n <= STEP:
        return has_duplicates(blocks, num_blocks)
    if num_blocks <= 64 * n + 4096:
        pos = np.zeros(num_blocks, dtype=np.int32 if n < 1 << 31 else np.int64)
        for i in range(0, n, STEP):
            yield None
            part = blocks[i:i + STEP]
            if pos[part].any():  # a block of an earlier part
                return True
            ids = np.arange(i + 1, i + 1 + part.size, dtype=pos.dtype)
            pos[part] = ids
            if not np.array_equal(pos[part], ids):  # a block twice within this part: one write lost
                return True
        return False
    s = yield (np.sort, blocks)  # numpy's sort releases the GIL: 100k blocks took 3.8 ms
    yield None
    return bool((s[1:] == s[:-1]).any())


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


def coalesce_steps(src: np.ndarray, dst: np.ndarray) -> Steps:
    """``coalesce`` in steps of ``STEP`` pairs (100k pairs at once took 0.4-0.9 ms)."""
    n, ch = src.size, STEP
    if n <= ch:
        return coalesce(src, dst)
    # Filled part by part rather than concatenated at the end: the pages of a fresh array are
    # touched (faulted in) a step at a time; one concatenation of 100k starts took 0.6-1.2 ms.
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    k = 1
    for i in range(1, n, ch):  # pairs i..j-1 that do not continue the pair before them
        j = min(n, i + ch)
        yield None
        brk = np.flatnonzero((src[i:j] - src[i - 1:j - 1] != 1) | (dst[i:j] - dst[i - 1:j - 1] != 1))
        brk += i
        starts[k:k + brk.size] = brk
        k += brk.size
    starts = starts[:k]
    yield None
    s0, d0, cnt = np.empty_like(starts), np.empty_like(starts), np.empty_like(starts)
    ends = np.append(starts[1:], n) if starts.size <= ch else None
    for i in range(0, starts.size, ch):
        yield None
        idx = starts[i:i + ch]
        s0[i:i + ch] = src[idx]
        d0[i:i + ch] = dst[idx]
        nxt = ends[i:i + ch] if ends is not None else np.append(starts[i + 1:i + ch + 1], n)[:idx.size]
        cnt[i:i + ch] = nxt - idx
    return s0, d0, cnt


def _scaled_steps(a: np.ndarray, k: int) -> Steps:
    """``a`` as uint64 times ``k``, ``STEP`` entries per step."""
    out = np.empty(a.size, dtype=np.uint64)
    for i in range(0, a.size, STEP):
        if a.size > STEP:
            yield None
        part = out[i:i + STEP]
        part[:] = a[i:i + STEP]
        part *= np.uint64(k)
    return out


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


def small_rows(src_addrs: list[int], src_offs: list[int], dst_addrs: list[int], dst_offs: list[int],
               src_t: Sequence[int], dst_t: Sequence[int], run_bytes: list[int], local_is_src: bool
               ) -> list[list[int]]:
    """The runs of a short plan as the five rows of a run table (``RunBatch.ROWS``: local address,
    remote address, length, local tensor, remote tensor), in Python ints: ``*_addrs`` are the
    tensors' start addresses, ``*_offs`` each run's byte offset inside a tensor."""
    if len(run_bytes) == 1:
        st, dt = list(src_t), list(dst_t)
        if len(st) == 1:  # a single run: the common tiny transfer
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
    return [sa, da, ln, st, dt] if local_is_src else [da, sa, ln, dt, st]


class Plan:
    """Runs between a source and a destination cache, as a (5, n) uint64 table in the row order
    of :class:`~kvflow.transport.RunBatch`: local address, remote address, length, local tensor,
    remote tensor (``local_is_src`` says which side is local).

    A plan of more than ``PIECE_RUNS`` runs keeps only its factors (each selected tensor pair's
    start addresses, each run's offsets and length: column ``i * runs + j`` is run ``j`` of pair
    ``i``) and makes tables of columns on demand (:meth:`batch`). A plan still being made
    (``pending``) holds the steps that make it: :meth:`steps` runs them where a loop can interleave
    them, anything else runs them at once."""

    __slots__ = ("_factors", "_pending", "_table", "local_is_src")

    def __init__(self, table: np.ndarray | None, local_is_src: bool) -> None:
        self._table = table
        self.local_is_src = local_is_src
        self._factors: tuple[np.ndarray, ...] | None = None
        self._pending: Steps | None = None

    @classmethod
    def deferred(cls, steps: Steps, local_is_src: bool) -> Plan:
        """A plan that ``steps`` make (their result is a Plan)."""
        plan = cls(None, local_is_src)
        plan._pending = steps
        return plan

    @property
    def pending(self) -> bool:
        """Whether the plan is still to be made (checks included: making it may raise)."""
        return self._pending is not None

    def steps(self) -> Steps:
        """The steps that make this plan (none once made); afterwards it is complete."""
        steps = self._pending
        if steps is None:
            return
        self._pending = None
        done = yield from steps
        self._adopt(done)

    def _adopt(self, done: Plan) -> None:
        self._table, self._factors = done._table, done._factors

    def _made(self) -> None:
        if self._pending is not None:
            steps, self._pending = self._pending, None
            self._adopt(run_steps(steps))

    @classmethod
    def build(cls, src_addrs: np.ndarray, src_stride: int, dst_addrs: np.ndarray, dst_stride: int,
              src_t: np.ndarray, dst_t: np.ndarray, src_start: np.ndarray, dst_start: np.ndarray,
              run_bytes: np.ndarray, local_is_src: bool) -> Plan:
        """Every selected tensor pair times every run (vectorised; a large plan kept as factors)."""
        return run_steps(cls.build_steps(src_addrs, src_stride, dst_addrs, dst_stride, src_t, dst_t, src_start,
                                         dst_start, run_bytes, local_is_src))

    @classmethod
    def build_steps(cls, src_addrs: np.ndarray, src_stride: int, dst_addrs: np.ndarray, dst_stride: int,
                    src_t: np.ndarray, dst_t: np.ndarray, src_start: np.ndarray, dst_start: np.ndarray,
                    run_bytes: np.ndarray, local_is_src: bool, run_scale: int = 1) -> Steps:
        """``build`` in steps of ``STEP`` runs; run ``j`` is ``run_bytes[j] * run_scale`` bytes."""
        nt, nr = src_t.size, src_start.size
        sa = src_addrs[src_t].astype(np.uint64)
        da = dst_addrs[dst_t].astype(np.uint64)
        st, dt = src_t.astype(np.uint64), dst_t.astype(np.uint64)
        so = yield from _scaled_steps(src_start, src_stride)
        do = yield from _scaled_steps(dst_start, dst_stride)
        ln = yield from _scaled_steps(run_bytes, run_scale)
        if not local_is_src:
            sa, da, so, do, st, dt = da, sa, do, so, dt, st
        plan = cls(None, local_is_src)
        plan._factors = (sa, da, so, do, ln, st, dt)
        if nt * nr <= PIECE_RUNS:
            plan._table = plan.columns(0, nt * nr)
            plan._factors = None
        return plan

    def __len__(self) -> int:
        self._made()
        if self._factors is None:
            assert self._table is not None
            return int(self._table.shape[1])
        return self._factors[0].size * self._factors[2].size

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves."""
        self._made()
        if self._factors is None:
            assert self._table is not None
            return int(self._table[2].sum())
        return int(self._factors[4].sum()) * self._factors[0].size

    @property
    def whole(self) -> bool:
        """Made, and held as one table (not factored): ``batch()`` costs nothing."""
        return self._table is not None

    def nbytes_of(self, a: int, b: int) -> int:
        """Bytes of runs ``a..b-1``."""
        self._made()
        if self._factors is None:
            assert self._table is not None
            return int(self._table[2, a:b].sum())
        ln = self._factors[4]
        nr = ln.size
        (i, j), (k, m) = divmod(a, nr), divmod(b, nr)
        if i == k:
            return int(ln[j:m].sum())
        return int(ln[j:].sum()) + (k - i - 1) * int(ln.sum()) + int(ln[:m].sum())

    def columns(self, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """Runs ``a..b-1`` as a (5, b-a) uint64 table: new, the plan's own, or ``out`` (a view of a larger one)."""
        self._made()
        f = self._factors
        if f is None:
            assert self._table is not None
            if out is not None:
                out[:] = self._table[:, a:b]
                return out
            return self._table if (a, b) == (0, self._table.shape[1]) else np.ascontiguousarray(self._table[:, a:b])
        la, ra, lo, ro, ln, lt, rt = f
        nr, c = lo.size, a
        out = np.empty((5, b - a), dtype=np.uint64) if out is None else out
        while c < b:
            i, j = divmod(c, nr)
            o = c - a
            if j == 0 and b - c >= nr:  # whole tensor pairs i..k-1, broadcast
                k = i + (b - c) // nr
                m = (k - i) * nr
                np.add(la[i:k, None], lo, out=out[0, o:o + m].reshape(k - i, nr))
                np.add(ra[i:k, None], ro, out=out[1, o:o + m].reshape(k - i, nr))
                out[2, o:o + m].reshape(k - i, nr)[:] = ln
                out[3, o:o + m].reshape(k - i, nr)[:] = lt[i:k, None]
                out[4, o:o + m].reshape(k - i, nr)[:] = rt[i:k, None]
            else:  # runs j.. of pair i
                m = min(nr - j, b - c)
                np.add(lo[j:j + m], la[i], out=out[0, o:o + m])  # no temporary: 16k runs in 2/3 of the time
                np.add(ro[j:j + m], ra[i], out=out[1, o:o + m])
                out[2, o:o + m] = ln[j:j + m]
                out[3, o:o + m] = lt[i]
                out[4, o:o + m] = rt[i]
            c += m
        return out

    @property
    def table(self) -> np.ndarray:
        """The whole (5, n) table (made now if the plan is factored: ``5 * 8 * n`` bytes)."""
        self._made()
        if self._table is None:
            self._table = self.columns(0, len(self))
            self._factors = None
        return self._table

    def tensor_columns(self, tensors: np.ndarray) -> list[int]:
        """The first column whose source tensor is at least each of ``tensors`` (in ascending source
        tensor order, as the planners make them)."""
        self._made()
        if self._factors is None:
            return np.searchsorted(self.src_tensor, tensors).tolist()
        st = self._factors[5 if self.local_is_src else 6].view(np.int64)
        return (np.searchsorted(st, tensors) * self._factors[2].size).tolist()

    @classmethod
    def small(cls, src_addrs: list[int], src_offs: list[int], dst_addrs: list[int], dst_offs: list[int],
              src_t: list[int], dst_t: list[int], run_bytes: list[int], local_is_src: bool) -> Plan:
        """The same runs as ``build``, computed in plain Python for short lists (``small_rows``)."""
        rows = small_rows(src_addrs, src_offs, dst_addrs, dst_offs, src_t, dst_t, run_bytes, local_is_src)
        flat = rows[0] + rows[1] + rows[2] + rows[3] + rows[4]
        return cls(np.fromiter(flat, _U64, len(flat)).reshape(5, -1), local_is_src)  # fromiter: the cheapest

    def batch(self, local: LocalCache, remote: RemoteCache, a: int = 0, b: int | None = None) -> RunBatch:
        """Runs ``a..b-1`` (all by default) as a transport's batch between ``local`` and ``remote``."""
        if a == 0 and b is None:
            return RunBatch.of_table(self.table, local, remote)
        return RunBatch.of_table(self.columns(a, len(self) if b is None else b), local, remote)

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


def _small_offsets(src: CacheDesc, dst: CacheDesc, src_blocks: BlockList,
                   dst_blocks: BlockList) -> tuple[list[int], list[int], list[int]] | None:
    """Short block lists checked and coalesced (``coalesce_small``); None when either list is not
    short, for the numpy path."""
    ss = small_block_list(src_blocks, src.num_blocks, "src_blocks")
    ds = small_block_list(dst_blocks, dst.num_blocks, "dst_blocks")
    if ss is None or ds is None:
        return None
    if len(ss) != len(ds):
        raise LLMParamInvalid(f"src_blocks has {len(ss)} entries, dst_blocks has {len(ds)}")
    if src.stride != dst.stride:
        raise LLMParamInvalid(f"block sizes differ: source {src.stride} bytes, destination {dst.stride}")
    if len(ds) > 1 and len(set(ds)) != len(ds):
        raise LLMParamInvalid("dst_blocks names a block more than once")
    return coalesce_small(ss, ds, src.stride)


def plan_blocks(src: CacheDesc, src_addrs: np.ndarray, dst: CacheDesc, dst_addrs: np.ndarray,
                src_blocks: BlockList, dst_blocks: BlockList, ext: KvCacheExtParam | None,
                local_is_src: bool = True) -> Plan:
    """Runs for a block-list transfer; every block and layer is checked."""
    s_t, d_t = _pairs(ext, src, dst)
    small = _small_offsets(src, dst, src_blocks, dst_blocks)
    if small is not None:
        so, do, nb = small
        if s_t.size * len(so) <= SMALL:
            return Plan.small(src_addrs.tolist(), so, dst_addrs.tolist(), do, s_t.tolist(), d_t.tolist(), nb,
                              local_is_src)
        return Plan.build(src_addrs, 1, dst_addrs, 1, s_t, d_t, np.array(so, dtype=np.int64),
                          np.array(do, dtype=np.int64), np.array(nb, dtype=np.int64), local_is_src)
    steps = _blocks_steps(src, src_addrs, dst, dst_addrs, src_blocks, dst_blocks, s_t, d_t, local_is_src)
    if is_long(src_blocks) or is_long(dst_blocks):
        return Plan.deferred(steps, local_is_src)
    return run_steps(steps)


def small_block_rows(src: CacheDesc, src_addrs: list[int], dst: CacheDesc, dst_addrs: list[int],
                     src_blocks: BlockList, dst_blocks: BlockList, local_is_src: bool) -> list[list[int]] | None:
    """``plan_blocks`` over every tensor (no ``ext_param``) for short lists, as ``small_rows``'s five
    rows with no numpy call; None where ``plan_blocks`` would build a table (long lists, many runs,
    different tensor counts). Bad input raises the same typed errors."""
    if src.num_tensors != dst.num_tensors:
        return None
    small = _small_offsets(src, dst, src_blocks, dst_blocks)
    if small is None or src.num_tensors * len(small[0]) > SMALL:
        return None
    so, do, nb = small
    t = _tensor_list(src.num_tensors)
    return small_rows(src_addrs, so, dst_addrs, do, t, t, nb, local_is_src)


def is_long(blocks: Any, limit: int = DEFER_BLOCKS) -> bool:
    """Whether a block list is longer than ``limit``: long enough to check and plan in steps."""
    try:
        return len(blocks) > limit
    except TypeError:
        return False


def _blocks_steps(src: CacheDesc, src_addrs: np.ndarray, dst: CacheDesc, dst_addrs: np.ndarray, src_blocks: BlockList,
                  dst_blocks: BlockList, s_t: np.ndarray, d_t: np.ndarray, local_is_src: bool) -> Steps:
    """``plan_blocks`` past its short-list path, in steps."""
    sb = yield from block_list_steps(src_blocks, src.num_blocks, "src_blocks")
    db = yield from block_list_steps(dst_blocks, dst.num_blocks, "dst_blocks")
    if sb.size != db.size:
        raise LLMParamInvalid(f"src_blocks has {sb.size} entries, dst_blocks has {db.size}")
    if src.stride != dst.stride:
        raise LLMParamInvalid(f"block sizes differ: source {src.stride} bytes, destination {dst.stride}")
    if (yield from duplicates_steps(db, dst.num_blocks)):
        raise LLMParamInvalid("dst_blocks names a block more than once")
    s0, d0, cnt = yield from coalesce_steps(sb, db)
    return (yield from Plan.build_steps(src_addrs, src.stride, dst_addrs, dst.stride, s_t, d_t, s0, d0, cnt,
                                        local_is_src, src.stride))


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
