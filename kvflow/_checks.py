"""Argument checks of the public API: every bad input gets LLMParamInvalid before a peer is asked."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._options import parse_address
from ._plan import Steps, block_list_steps, duplicates_steps, is_long, run_steps, side_tensors
from ._status import LLMClusterNumExceedLimit, LLMParamInvalid
from ._types import CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam

MAX_CLUSTERS_PER_CALL = 16
MAX_TIMEOUT_MS = 24 * 3600 * 1000


def check_int(name: str, value: Any, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    """``value`` as an int in ``lo..hi`` (bools refused), else LLMParamInvalid naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) <= hi:
        raise LLMParamInvalid(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return int(value)


def check_index(ci: CacheIndex, blocks: bool) -> CacheIndex:
    """A CacheIndex naming a peer's cache; ``batch_index`` must be 0 for block transfers."""
    if type(ci) is CacheIndex:  # the common case, checked without calls
        c, k, b = ci.cluster_id, ci.cache_id, ci.batch_index
        if (type(c) is int and type(k) is int and type(b) is int
                and 0 <= c < 1 << 64 and 0 < k < 1 << 64 and (b == 0 or (not blocks and 0 < b < 1 << 32))):
            return ci
    if not isinstance(ci, CacheIndex):
        raise LLMParamInvalid(f"expected a CacheIndex, got {type(ci).__name__}")
    check_int("cluster_id", ci.cluster_id)
    check_int("cache_id", ci.cache_id, 1)
    check_int("batch_index", ci.batch_index, 0, (1 << 32) - 1)
    if blocks and ci.batch_index != 0:
        raise LLMParamInvalid("batch_index must be 0 for block transfers")
    return ci


def blocks_precheck(desc: CacheDesc, local_blocks: Any, remote_blocks: Any, ext: KvCacheExtParam | None,
                    local_is_src: bool) -> None:
    """The checks of a block transfer that need only the local cache."""
    run_steps(_blocks_precheck(desc, local_blocks, remote_blocks, ext, local_is_src))


def blocks_precheck_steps(desc: CacheDesc, local_blocks: Any, remote_blocks: Any, ext: KvCacheExtParam | None,
                          local_is_src: bool) -> Steps | None:
    """``blocks_precheck`` done at once (None), or for long block lists returned as steps
    (``kvflow._plan``) that the caller must run."""
    steps = _blocks_precheck(desc, local_blocks, remote_blocks, ext, local_is_src)
    if is_long(local_blocks) or is_long(remote_blocks):
        return steps
    run_steps(steps)
    return None


def _blocks_precheck(desc: CacheDesc, local_blocks: Any, remote_blocks: Any, ext: KvCacheExtParam | None,
                     local_is_src: bool) -> Steps:
    side_tensors(ext, desc, local_is_src)
    lb = yield from block_list_steps(local_blocks, desc.num_blocks, "src_blocks" if local_is_src else "dst_blocks")
    rb = yield from block_list_steps(remote_blocks, 1 << 62, "dst_blocks" if local_is_src else "src_blocks")
    if lb.size != rb.size:
        raise LLMParamInvalid(f"src_blocks has {(lb if local_is_src else rb).size} entries, "
                              f"dst_blocks has {(rb if local_is_src else lb).size}")
    if not local_is_src and (yield from duplicates_steps(lb, desc.num_blocks)):
        raise LLMParamInvalid("dst_blocks names a block more than once")


def cache_precheck(desc: CacheDesc, batch_index: Any, size: Any, ext: KvCacheExtParam | None,
                   local_is_src: bool) -> None:
    """The checks of a whole-slot transfer that need only the local cache."""
    side_tensors(ext, desc, local_is_src)
    what = "src_batch_index" if local_is_src else "batch_index"
    check_int(what, batch_index, 0, desc.num_blocks - 1)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise LLMParamInvalid(f"size must be an int, got {size!r}")
    if size != -1 and not 0 < size <= desc.stride:
        raise LLMParamInvalid(f"size {size} must be -1 or in 1..{desc.stride} (bytes per tensor slot)")


def check_clusters(clusters: Sequence[ClusterInfo]) -> list[ClusterInfo]:
    """At most 16 ClusterInfo, each cluster id once."""
    if isinstance(clusters, ClusterInfo) or not isinstance(clusters, Sequence):
        raise LLMParamInvalid("clusters must be a list of ClusterInfo")
    if len(clusters) > MAX_CLUSTERS_PER_CALL:
        raise LLMClusterNumExceedLimit(f"{len(clusters)} clusters in one call; at most {MAX_CLUSTERS_PER_CALL}")
    seen: set[int] = set()
    for c in clusters:
        if not isinstance(c, ClusterInfo):
            raise LLMParamInvalid(f"expected ClusterInfo, got {type(c).__name__}")
        check_int("remote_cluster_id", c.remote_cluster_id)
        if c.remote_cluster_id in seen:
            raise LLMParamInvalid(f"cluster {c.remote_cluster_id} appears twice in one call")
        seen.add(c.remote_cluster_id)
    return list(clusters)


def wire_address(ip: str, port: int) -> tuple[str, int]:
    """(ip, port) of an IpInfo, checked as a listen address is."""
    host = ip if ":" not in ip else f"[{ip}]"
    return parse_address("remote_ip_infos", f"{host}:{port}")
