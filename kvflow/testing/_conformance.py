"""``check_transport``: the conformance suite every transport's own tests call.

It runs two ``LlmDataDist`` instances in this process, on the running event loop, linked
over loopback with the transport pinned, and checks through the public API that the
transport moves exactly the requested bytes: whole slots and block lists, both directions,
scattered and contiguous, single blocks (the batches ``read_now`` may take), batches larger
than ``IOV_MAX`` runs, concurrent transfers on one link, a remote cache that does not exist,
and pulls cancelled mid-transfer (some blocks landed, not all): each must end cancelled, and
no byte may land after it did.
Guard bytes around every registered tensor must stay untouched throughout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from .._compat import timeout as timeout_after
from .._datadist import LlmDataDist
from .._status import LLMKvCacheNotExist
from .._types import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmRole

__all__ = ["check_transport"]

GUARD = 4096
_HEAD, _TAIL, _SENTINEL = 0xA5, 0x5A, 0xEE
_OP_MS = 30_000  # per-transfer deadline inside the suite


class _Guarded:
    """``num_tensors`` host tensors, each between two guard zones, registered by buffer."""

    def __init__(self, desc: CacheDesc, rng: np.random.Generator | None) -> None:
        self.desc = desc
        n = desc.tensor_bytes
        self.raw = [np.empty(2 * GUARD + n, dtype=np.uint8) for _ in range(desc.num_tensors)]
        for r in self.raw:
            r[:GUARD] = _HEAD
            r[GUARD + n :] = _TAIL
            r[GUARD : GUARD + n] = rng.integers(0, 256, n, dtype=np.uint8) if rng is not None else 0
        self.tensors = [r[GUARD : GUARD + n] for r in self.raw]

    def blocks(self, t: int) -> np.ndarray:
        """Tensor ``t`` as (blocks, bytes per block)."""
        return self.tensors[t].reshape(self.desc.num_blocks, self.desc.stride)

    def snapshot(self) -> list[np.ndarray]:
        return [t.copy() for t in self.tensors]

    def randomize(self, rng: np.random.Generator) -> None:
        for t in self.tensors:
            t[:] = rng.integers(0, 256, t.size, dtype=np.uint8)

    def check_guards(self, what: str) -> None:
        n = self.desc.tensor_bytes
        for i, r in enumerate(self.raw):
            if not (np.all(r[:GUARD] == _HEAD) and np.all(r[GUARD + n :] == _TAIL)):
                raise AssertionError(f"{what}: guard bytes around tensor {i} were overwritten")


def _same(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        if not np.array_equal(g, w):
            bad = int(np.flatnonzero(g != w)[0])
            raise AssertionError(f"{what}: tensor {t} differs first at byte {bad}")


class _Suite:
    def __init__(self, name: str, a: LlmDataDist, b: LlmDataDist, rng: np.random.Generator) -> None:
        self.name = name
        self.a, self.b = a, b  # b linked to a
        self.rng = rng
        self.guarded: list[_Guarded] = []
        self._caches: dict[int, Cache] = {}

    async def cache(self, dd: LlmDataDist, desc: CacheDesc, random: bool = True) -> tuple[_Guarded, int]:
        g = _Guarded(desc, self.rng if random else None)
        cache = await dd.register_kv_cache(desc, g.tensors)
        self.guarded.append(g)
        self._caches[id(g)] = cache
        return g, cache.cache_id

    def handle(self, g: _Guarded) -> Cache:
        return self._caches[id(g)]

    def guards(self, what: str) -> None:
        for g in self.guarded:
            g.check_guards(what)

    # ---------------------------------------------------------------- checks
    async def whole_slots(self) -> None:
        desc = CacheDesc(num_tensors=4, data_type=DataType.DT_FLOAT16, shape=[8, 2048])
        src, src_id = await self.cache(self.a, desc)
        dst, _ = await self.cache(self.b, desc, random=False)
        want = dst.snapshot()
        for slot in range(desc.num_blocks):  # pull every slot, reversed
            other = desc.num_blocks - 1 - slot
            await self.b.pull_kv_cache(CacheIndex(self.a.cluster_id, src_id, slot), self.handle(dst), other,
                                       timeout_in_millis=_OP_MS)
            for t in range(4):
                want[t].reshape(desc.num_blocks, -1)[other] = src.blocks(t)[slot]
        _same(dst.tensors, want, "pull_kv_cache (all slots)")
        # a partial slot (size) between selected layers: tensors 0,1 -> 2,3
        half = desc.stride // 2 + 1
        ext = KvCacheExtParam(src_layer_range=(0, 0), dst_layer_range=(1, 1), tensor_num_per_layer=2)
        await self.b.pull_kv_cache(CacheIndex(self.a.cluster_id, src_id, 3), self.handle(dst), 5, half, ext,
                                   timeout_in_millis=_OP_MS)
        for s, d in ((0, 2), (1, 3)):
            want[d].reshape(desc.num_blocks, -1)[5, :half] = src.blocks(s)[3, :half]
        _same(dst.tensors, want, "pull_kv_cache (size, layer range)")
        # push every slot back from b into a fresh cache on a
        back, back_id = await self.cache(self.a, desc, random=False)
        dst.randomize(self.rng)
        for slot in range(desc.num_blocks):
            await self.b.push_kv_cache(self.handle(dst), CacheIndex(self.a.cluster_id, back_id, slot), slot,
                                       timeout_in_millis=_OP_MS)
        _same(back.tensors, dst.tensors, "push_kv_cache (all slots)")
        self.guards("whole-slot transfers")

    async def blocks(self) -> None:
        nb = 64
        desc = CacheDesc(num_tensors=4, data_type=DataType.DT_INT32, shape=[nb, 1024])  # 4 KiB blocks
        src, src_id = await self.cache(self.a, desc)
        dst, dst_id = await self.cache(self.b, desc, random=False)
        ci = CacheIndex(self.a.cluster_id, src_id)
        want = dst.snapshot()

        async def pull(sb: np.ndarray, db: np.ndarray, what: str) -> None:
            await self.b.pull_kv_blocks(ci, self.handle(dst), sb.tolist(), db.tolist(),
                                        timeout_in_millis=_OP_MS)
            for t in range(4):
                want[t].reshape(nb, -1)[db] = src.blocks(t)[sb]
            _same(dst.tensors, want, what)

        perm = self.rng.permutation(nb)
        await pull(perm[:40], self.rng.permutation(nb)[:40], "pull_kv_blocks (scattered)")
        await pull(np.arange(8, 24), np.arange(30, 46), "pull_kv_blocks (one contiguous run)")
        await pull(np.array([0, 1, 2, 10, 11, 40]), np.array([5, 6, 7, 20, 21, 63]), "pull_kv_blocks (runs)")
        # push: b's blocks into a
        dst.randomize(self.rng)
        want_a = src.snapshot()
        sb, db = self.rng.permutation(nb)[:33], self.rng.permutation(nb)[:33]
        await self.b.push_kv_blocks(self.handle(dst), CacheIndex(self.a.cluster_id, src_id), sb.tolist(),
                                    db.tolist(), timeout_in_millis=_OP_MS)
        for t in range(4):
            want_a[t].reshape(nb, -1)[db] = dst.blocks(t)[sb]
        _same(src.tensors, want_a, "push_kv_blocks (scattered)")
        # a pushes into b too: roles restrict nothing, either side may initiate
        src.randomize(self.rng)
        want = dst.snapshot()
        await self.a.push_kv_blocks(self.handle(src), CacheIndex(self.b.cluster_id, dst_id), [1, 2, 3],
                                    [9, 8, 7], timeout_in_millis=_OP_MS)
        for t in range(4):
            want[t].reshape(nb, -1)[[9, 8, 7]] = src.blocks(t)[[1, 2, 3]]
        _same(dst.tensors, want, "push_kv_blocks from the accepting side")
        # single blocks: the tiny batches a transport may move at once (Endpoint.read_now / write_now)
        for _ in range(8):
            s, d = (int(x) for x in self.rng.integers(0, nb, 2))
            await self.b.pull_kv_blocks(ci, self.handle(dst), [s], [d], timeout_in_millis=_OP_MS)
            for t in range(4):
                want[t].reshape(nb, -1)[d] = src.blocks(t)[s]
            _same(dst.tensors, want, "pull_kv_blocks (one block)")
            for t in range(4):  # new bytes in that block, then back to the source
                dst.blocks(t)[d] = want[t].reshape(nb, -1)[d] = self.rng.integers(0, 256, desc.stride, np.uint8)
            await self.b.push_kv_blocks(self.handle(dst), ci, [d], [s], timeout_in_millis=_OP_MS)
            for t in range(4):
                if not np.array_equal(src.blocks(t)[s], dst.blocks(t)[d]):
                    raise AssertionError("push_kv_blocks (one block): contents differ")
        self.guards("block transfers")

    async def many_runs(self) -> None:
        nb = 2048  # every other block, reversed: 4 tensors x 1024 runs, far over IOV_MAX
        desc = CacheDesc(num_tensors=4, data_type=DataType.DT_UINT8, shape=[nb, 256])
        src, src_id = await self.cache(self.a, desc)
        dst, _ = await self.cache(self.b, desc, random=False)
        sb = np.arange(0, nb, 2)
        db = sb[::-1].copy()
        await self.b.pull_kv_blocks(CacheIndex(self.a.cluster_id, src_id), self.handle(dst), sb.tolist(),
                                    db.tolist(), timeout_in_millis=_OP_MS)
        want = [np.zeros(desc.tensor_bytes, dtype=np.uint8) for _ in range(4)]
        for t in range(4):
            want[t].reshape(nb, -1)[db] = src.blocks(t)[sb]
        _same(dst.tensors, want, "pull of 4096 runs")
        dst.randomize(self.rng)
        await self.b.push_kv_blocks(self.handle(dst), CacheIndex(self.a.cluster_id, src_id), db.tolist(),
                                    sb.tolist(), timeout_in_millis=_OP_MS)
        for t in range(4):
            if not np.array_equal(src.blocks(t)[sb], dst.blocks(t)[db]):
                raise AssertionError("push of 4096 runs: contents differ")
        self.guards("4096-run transfers")

    async def missing_cache(self) -> None:
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[4, 512])
        src, src_id = await self.cache(self.a, desc)
        dst, _ = await self.cache(self.b, desc, random=False)
        try:
            await self.b.pull_kv_blocks(CacheIndex(self.a.cluster_id, 987654), self.handle(dst), [0], [0],
                                        timeout_in_millis=_OP_MS)
        except LLMKvCacheNotExist:
            pass
        else:
            raise AssertionError("pull from an unknown remote cache did not raise LLMKvCacheNotExist")
        await self.b.pull_kv_blocks(CacheIndex(self.a.cluster_id, src_id), self.handle(dst), [0, 1, 2, 3],
                                    [3, 2, 1, 0], timeout_in_millis=_OP_MS)
        _same([dst.blocks(t) for t in range(2)], [src.blocks(t)[::-1] for t in range(2)],
              "pull after LLMKvCacheNotExist")
        # a cache unregistered by the peer is gone; one registered after linking is visible
        await self.a.unregister_kv_cache(src_id)
        self.guarded.remove(src)
        try:
            await self.b.pull_kv_blocks(CacheIndex(self.a.cluster_id, src_id), self.handle(dst), [0], [0],
                                        timeout_in_millis=_OP_MS)
        except LLMKvCacheNotExist:
            pass
        else:
            raise AssertionError("pull from an unregistered remote cache did not raise LLMKvCacheNotExist")
        new, new_id = await self.cache(self.a, desc)
        await self.b.pull_kv_blocks(CacheIndex(self.a.cluster_id, new_id), self.handle(dst), [0, 1, 2, 3],
                                    [0, 1, 2, 3], timeout_in_millis=_OP_MS)
        _same(dst.tensors, new.tensors, "pull from a cache registered after linking")
        self.guards("missing caches")

    async def concurrent(self, count: int = 32) -> None:
        nb = 4 * count
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[nb, 16384])
        src, src_id = await self.cache(self.a, desc)
        dst, _ = await self.cache(self.b, desc, random=False)
        perm = self.rng.permutation(nb)
        ci = CacheIndex(self.a.cluster_id, src_id)
        jobs = [self.b.pull_kv_blocks(ci, self.handle(dst), perm[4 * i : 4 * i + 4].tolist(),
                                      list(range(4 * i, 4 * i + 4)), timeout_in_millis=_OP_MS)
                for i in range(count)]
        await asyncio.gather(*jobs)
        _same([dst.blocks(t) for t in range(2)], [src.blocks(t)[perm] for t in range(2)],
              f"{count} concurrent pulls")
        self.guards("concurrent transfers")

    async def cancel(self) -> None:
        """Pulls cancelled while in flight: each raises CancelledError, and no byte lands afterwards.

        The cancels are timed at fractions of a measured uncancelled pull of the same batch; the check
        fails unless at least two of them caught the pull with some of its bytes landed and not all
        (the cancel arrived mid-transfer, not before the first byte or after the last)."""
        desc = CacheDesc(num_tensors=4, data_type=DataType.DT_UINT8, shape=[256, 64 << 10])  # 64 MiB
        src, src_id = await self.cache(self.a, desc)
        dst, _ = await self.cache(self.b, desc, random=False)
        ci = CacheIndex(self.a.cluster_id, src_id)
        nb = desc.num_blocks
        blocks = list(range(nb))
        loop = asyncio.get_running_loop()

        def landed() -> np.ndarray:
            """(tensor, block, head/tail): whether the first and the last 64 bytes of each block already
            hold the source's (src block b lands in dst block nb-1-b; random 64 bytes do not match the
            sentinel by chance). Cheap enough to take at the very moment a call is cancelled or returns."""
            return np.stack([np.stack([np.all(dst.blocks(t)[::-1, :64] == src.blocks(t)[:, :64], axis=1),
                                       np.all(dst.blocks(t)[::-1, -64:] == src.blocks(t)[:, -64:], axis=1)],
                                      axis=1) for t in range(desc.num_tensors)])

        def pull() -> asyncio.Future[None]:
            return asyncio.ensure_future(self.b.pull_kv_blocks(ci, self.handle(dst), blocks, blocks[::-1],
                                                               timeout_in_millis=_OP_MS))

        # how long the whole batch takes here: the cancels are timed at fractions of it
        for t in dst.tensors:
            t[:] = _SENTINEL
        t0 = loop.time()
        await pull()
        full = loop.time() - t0
        _same([dst.blocks(t)[::-1] for t in range(4)], [src.blocks(t) for t in range(4)], "uncancelled pull")
        total = desc.num_tensors * nb
        mid, seen = 0, []
        for i, frac in enumerate((0.0, 0.3, 0.6, 0.1, 0.45, 0.8, 0.2, 0.05, 0.7, 0.35, 0.9, 0.15)):
            for t in dst.tensors:
                t[:] = _SENTINEL
            task = pull()
            await asyncio.sleep(frac * full)
            if task.done():  # finished before the cancel: not a cancellation, but the bytes must be right
                await task
                _same([dst.blocks(t)[::-1] for t in range(4)], [src.blocks(t) for t in range(4)],
                      "pull that finished before its cancel")
                seen.append(f"{frac:.2f}: finished first")
                continue
            at_cancel = landed()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            heads, tails = (int(np.count_nonzero(at_cancel[:, :, k])) for k in (0, 1))
            state = f"{heads}/{total} block heads and {tails}/{total} tails landed"
            if not task.cancelled():
                raise AssertionError(f"a pull cancelled in flight ({state}) did not end cancelled")
            at_return = landed()  # first: a copy still running would land more while the snapshot is taken
            after = dst.snapshot()
            await asyncio.sleep(0.1)
            what = f"bytes landed after a cancelled pull returned (at {frac:.2f} of {full * 1e3:.1f} ms)"
            if not np.array_equal(landed(), at_return):
                raise AssertionError(f"{what}: {int(np.count_nonzero(landed() != at_return))} block heads/tails")
            _same(dst.tensors, after, what)
            for ti in range(4):
                got, want = dst.blocks(ti)[::-1], src.blocks(ti)
                if not np.all((got == _SENTINEL) | (got == want)):
                    raise AssertionError("a cancelled pull wrote bytes that are not the source's")
            if heads > 0 and tails < total:  # the first bytes had landed, the last had not
                mid += 1
            seen.append(f"{frac:.2f}: cancelled with {state}")
            if mid >= 2 and i >= 3:
                break
        if mid < 2:
            raise AssertionError(f"{self.name}: fewer than two cancels arrived mid-transfer (a whole pull: "
                                 f"{full * 1e3:.1f} ms): {'; '.join(seen)}")
        # the link is still usable and exact
        await self.b.pull_kv_blocks(ci, self.handle(dst), blocks, blocks, timeout_in_millis=_OP_MS)
        _same(dst.tensors, src.tensors, "pull after cancellations")
        self.guards("cancelled transfers")


async def check_transport(name: str, *, options: Mapping[str, str] | None = None, seed: int = 0,
                          timeout: float = 300.0) -> None:
    """Run the conformance suite for transport ``name``; raises AssertionError (or the failing
    kvflow exception) at the first check that fails.

    ``options`` are extra ``initialize`` options for both sides (e.g. transport tuning keys).
    """
    opts = {"llm.ListenIpInfo": "127.0.0.1:0", **(options or {}), "kvflow.Transports": name}
    rng = np.random.default_rng(seed)
    async with timeout_after(timeout):
        async with LlmDataDist(9101, LlmRole.PROMPT, options=opts) as a, \
                LlmDataDist(9102, LlmRole.DECODER, options=opts) as b:
            assert a.listen_address is not None
            host, port = a.listen_address
            rets = await b.link_llm_clusters([ClusterInfo(a.cluster_id, [IpInfo(host, port)])], 10_000)
            if [int(r) for r in rets] != [0]:
                raise AssertionError(f"link over {name} failed: {rets}")
            for dd, peer in ((b, a), (a, b)):
                info = dd.link_info(peer.cluster_id)
                if info.transport != name:
                    raise AssertionError(f"link uses {info.transport!r}, not {name!r} ({info.fallbacks})")
            suite = _Suite(name, a, b, rng)
            await suite.whole_slots()
            await suite.blocks()
            await suite.many_runs()
            await suite.missing_cache()
            await suite.concurrent()
            await suite.cancel()
            for dd, peer in ((b, a), (a, b)):
                if dd.link_info(peer.cluster_id).state != "linked":
                    raise AssertionError(f"link is {dd.link_info(peer.cluster_id).state} after the suite")
            await b.unlink_llm_clusters([ClusterInfo(a.cluster_id, [IpInfo(host, port)])], 10_000)
