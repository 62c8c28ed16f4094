"""Planning: block lists and layer ranges to coalesced runs (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvflow import CacheDesc, DataType, KvCacheExtParam, LLMParamInvalid
from kvflow._plan import SMALL, coalesce, has_duplicates, layer_tensors, plan_blocks, plan_cache, small_block_rows

DESC = CacheDesc(4, DataType.DT_INT32, [8, 16])
SRC = np.array([0x10000, 0x20000, 0x30000, 0x40000], dtype=np.uint64)
DST = np.array([0x90000, 0xA0000, 0xB0000, 0xC0000], dtype=np.uint64)


def test_contiguous_pairs_coalesce() -> None:
    s0, d0, n = coalesce(np.array([0, 1, 2, 7, 8, 3]), np.array([4, 5, 6, 0, 1, 2]))
    assert s0.tolist() == [0, 7, 3] and d0.tolist() == [4, 0, 2] and n.tolist() == [3, 2, 1]


def test_seed_mapping_runs() -> None:
    p = plan_blocks(DESC, SRC, DESC, DST, [0, 1, 2, 3], [3, 2, 1, 0], None)
    stride = DESC.stride
    assert p.length.tolist() == [stride] * 16  # reversed order: nothing coalesces, 4 blocks x 4 tensors
    assert (p.src_addr[:4] - SRC[0]).tolist() == [0, stride, 2 * stride, 3 * stride]
    assert (p.dst_addr[:4] - DST[0]).tolist() == [3 * stride, 2 * stride, stride, 0]


def test_layer_range_selects_tensors() -> None:
    assert layer_tensors((1, 1), 8, 2, "r").tolist() == [2, 3]
    assert layer_tensors(range(1, 3), 8, 2, "r").tolist() == [2, 3, 4, 5]
    assert layer_tensors((-1, -1), 8, 2, "r").tolist() == list(range(8))
    for bad in [(0, 4), (2, 1), (-1, 0), range(0, 4, 2), range(2, 2), "ab"]:
        with pytest.raises(LLMParamInvalid):
            layer_tensors(bad, 8, 2, "r")
    with pytest.raises(LLMParamInvalid):
        layer_tensors((0, 0), 8, 3, "r")


def test_cache_plan_size_and_batch() -> None:
    p = plan_cache(DESC, SRC, 5, DESC, DST, 2, 24, KvCacheExtParam((1, 1), (0, 0), 2))
    assert p.length.tolist() == [24, 24]
    assert (p.src_addr - SRC[[2, 3]]).tolist() == [5 * DESC.stride] * 2
    assert (p.dst_addr - DST[[0, 1]]).tolist() == [2 * DESC.stride] * 2
    for args in [(8, 0, -1), (0, 8, -1), (0, 0, DESC.stride + 1), (0, 0, 0), (0, 0, -3)]:
        with pytest.raises(LLMParamInvalid):
            plan_cache(DESC, SRC, args[0], DESC, DST, args[1], args[2], None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=40, unique_by=lambda p: p[1]),
       st.booleans())
@example([(i, i) for i in range(SMALL + 1)], True)  # too long for the short path, yet coalesced into one run per tensor
def test_small_and_vectorised_paths_agree(pairs: list[tuple[int, int]], local_is_src: bool) -> None:
    """Lists of up to SMALL blocks take a plain-Python path; both paths give the same bytes, and
    both tables put the local side first."""
    desc = CacheDesc(2, DataType.DT_UINT8, [64, 8])
    a = np.array([1 << 20, 2 << 20], dtype=np.uint64)
    b = np.array([3 << 20, 4 << 20], dtype=np.uint64)
    src = [p[0] for p in pairs]
    dst = [p[1] for p in pairs]
    fast = plan_blocks(desc, a, desc, b, src, dst, None, local_is_src)
    vec = plan_blocks(desc, a, desc, b, np.array(src), np.array(dst), None, local_is_src)  # arrays take numpy

    def expand(p):  # every byte mapping with its tensors, independent of how runs were cut
        out = set()
        rows = zip(p.src_addr.tolist(), p.dst_addr.tolist(), p.length.tolist(), p.src_tensor.tolist(),
                   p.dst_tensor.tolist())
        for s, d, n, ts, td in rows:
            out.update((s + i, d + i, ts, td) for i in range(n))
        return out

    want = {(int(a[t]) + s * 8 + i, int(b[t]) + d * 8 + i, t, t)
            for t in range(2) for s, d in pairs for i in range(8)}
    assert expand(fast) == expand(vec) == want
    for p in (fast, vec):
        assert p.table.dtype == np.uint64 and p.table.flags.c_contiguous
        local, remote = (p.src_addr, p.dst_addr) if local_is_src else (p.dst_addr, p.src_addr)
        assert p.table[0].tolist() == local.tolist() and p.table[1].tolist() == remote.tolist()
    # the rows tcp's blocks_now sends: Python ints in the same table, or None where a table is due
    rows = small_block_rows(desc, a.tolist(), desc, b.tolist(), src, dst, local_is_src)
    if len(pairs) <= SMALL and len(fast) <= SMALL:  # plan_blocks' own short path, in Python ints
        assert rows == fast.table.tolist()
    else:
        assert rows is None


@pytest.mark.parametrize("src, dst", [([0, 1], [2]), ([64], [0]), ([0], [-1]), ([0, 1], [3, 3]), ([True], [0]),
                                      (["1"], [0])])
def test_small_rows_refuse_what_plan_blocks_refuses(src: list, dst: list) -> None:
    desc = CacheDesc(2, DataType.DT_UINT8, [64, 8])
    a, b = [1 << 20, 2 << 20], [3 << 20, 4 << 20]
    with pytest.raises(LLMParamInvalid) as planned:
        plan_blocks(desc, np.array(a, dtype=np.uint64), desc, np.array(b, dtype=np.uint64), src, dst, None)
    with pytest.raises(LLMParamInvalid) as rows:
        small_block_rows(desc, a, desc, b, src, dst, True)
    assert str(rows.value) == str(planned.value)


def test_small_rows_leave_other_strides_and_tensor_counts_to_plan_blocks() -> None:
    a, b = [1 << 20, 2 << 20], [3 << 20, 4 << 20]
    two, other = CacheDesc(2, DataType.DT_UINT8, [64, 8]), CacheDesc(2, DataType.DT_UINT8, [64, 16])
    with pytest.raises(LLMParamInvalid, match="block sizes differ"):
        small_block_rows(two, a, other, b, [0], [0], True)
    assert small_block_rows(two, a, CacheDesc(1, DataType.DT_UINT8, [64, 8]), b[:1], [0], [0], True) is None


def test_whole_slot_plan_small_and_vectorised_agree() -> None:
    """plan_cache computes up to SMALL tensors in Python, more with numpy: the same runs."""
    for tensors in (SMALL, SMALL + 2):
        desc = CacheDesc(tensors, DataType.DT_UINT8, [4, 32])
        a = np.arange(1, tensors + 1, dtype=np.uint64) << np.uint64(20)
        b = a + np.uint64(1 << 40)
        for local_is_src in (True, False):
            p = plan_cache(desc, a, 3, desc, b, 1, 20, None, local_is_src)
            assert p.length.tolist() == [20] * tensors
            assert (p.src_addr - a).tolist() == [3 * 32] * tensors
            assert (p.dst_addr - b).tolist() == [32] * tensors
            assert p.src_tensor.tolist() == p.dst_tensor.tolist() == list(range(tensors))


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300), st.sampled_from([5001, 1 << 40]))
def test_has_duplicates_agrees_with_a_set_on_both_paths(blocks: list[int], num_blocks: int) -> None:
    # num_blocks 5001: the per-block count; 2**40: the sort (the count would need too much memory)
    assert has_duplicates(np.array(blocks, dtype=np.int64), num_blocks) == (len(set(blocks)) != len(blocks))


def _expanded(p: object, stride: int) -> list[tuple[int, int, int, int]]:
    """A plan's runs cut back into blocks: (source address, destination address, src tensor, dst tensor)."""
    t = p.table  # type: ignore[attr-defined]
    out = []
    for sa, da, ln, st_, dt_ in zip(p.src_addr.tolist(), p.dst_addr.tolist(), t[2].tolist(),  # type: ignore[attr-defined]
                                    p.src_tensor.tolist(), p.dst_tensor.tolist()):  # type: ignore[attr-defined]
        out += [(sa + k * stride, da + k * stride, st_, dt_) for k in range(ln // stride)]
    return out


@pytest.mark.parametrize("local_is_src", [True, False])
def test_a_long_block_list_is_planned_in_steps_into_the_same_runs_as_block_by_block(local_is_src: bool) -> None:
    from kvflow._plan import PIECE_RUNS, STEP, run_steps

    nb = 3 * STEP + 5
    desc = CacheDesc(3, DataType.DT_UINT8, [2 * nb, 16])
    src_addrs = np.array([1 << 32, 2 << 32, 3 << 32], dtype=np.uint64)
    dst_addrs = src_addrs + np.uint64(1 << 20)
    rng = np.random.default_rng(7)
    sb = rng.permutation(2 * nb)[:nb]
    sb[100:900] = np.arange(800) + 5  # some runs that coalesce
    sb = list(dict.fromkeys(sb.tolist()))
    db = (np.arange(len(sb)) * 2 % (2 * len(sb))).tolist()
    db[200:700] = list(range(3 * nb // 2, 3 * nb // 2 + 500))
    db = list(dict.fromkeys(db))[:len(sb)]
    sb = sb[:len(db)]
    p = plan_blocks(desc, src_addrs, desc, dst_addrs, sb, db, None, local_is_src)
    assert p.pending  # long lists: nothing was done yet
    run_steps(p.steps())
    assert len(p) > PIECE_RUNS and not p.whole  # kept as factors
    pieces = [p.columns(a, min(len(p), a + 1000)) for a in range(0, len(p), 1000)]
    assert sum(p.nbytes_of(a, min(len(p), a + 1000)) for a in range(0, len(p), 1000)) == p.nbytes
    want = [(int(src_addrs[t]) + s * 16, int(dst_addrs[t]) + d * 16, t, t) for t in range(3) for s, d in zip(sb, db)]
    assert _expanded(p, 16) == want
    into = np.zeros((5, len(p)), dtype=np.uint64)  # as the engine makes a large batch: slice by slice
    for a in range(0, len(p), 1000):
        p.columns(a, min(len(p), a + 1000), into[:, a:a + 1000])
    assert np.array_equal(np.concatenate(pieces, axis=1), p.table)
    assert np.array_equal(into, p.table)
    into[:] = 0  # and from a whole table, no longer factored
    p.columns(7, len(p) - 3, into[:, 7:len(p) - 3])
    assert np.array_equal(into[:, 7:len(p) - 3], p.table[:, 7:len(p) - 3]) and not into[:, :7].any()


def test_long_block_lists_get_the_same_typed_errors_as_short_ones() -> None:
    from kvflow._plan import STEP, run_steps

    nb = 2 * STEP + 3
    desc = CacheDesc(2, DataType.DT_UINT8, [nb, 16])
    ok = list(range(nb))
    for bad_src, bad_dst, what in (([*ok[:-1], nb], ok, "outside"), (ok, [*ok[:-1], 1.5], "integers"),
                                    (ok, [*ok[:-1], 0], "more than once"), (ok[:-1], ok, "entries")):
        p = plan_blocks(desc, SRC[:2], desc, DST[:2], bad_src, bad_dst, None)
        with pytest.raises(LLMParamInvalid, match=what):
            run_steps(p.steps())
