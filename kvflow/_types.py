"""Value types of the public API (names follow LLM-DataDist)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any, Sequence, Union

import numpy as np

from ._status import LLMParamInvalid


class LlmRole(IntEnum):
    """A label for the instance; it restricts nothing ("not restricted by the node role")."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(IntEnum):
    """Where a cache's memory lives."""

    HOST = 0
    DEVICE = 1


class DataType(IntEnum):
    """Element types, with the numbering LLM-DataDist (GE) uses."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


@dataclass(frozen=True)
class IpInfo:
    """One IP address and port."""

    ip: str
    port: int = 0


@dataclass
class ClusterInfo:
    """A peer to link to: its cluster id and where it listens (exactly one remote address)."""

    remote_cluster_id: int
    remote_ip_infos: list[IpInfo] = field(default_factory=list)
    local_ip_infos: list[IpInfo] = field(default_factory=list)
    remote_role_type: int = 0

    def append_remote_ip_info(self, ip: str, port: int) -> None:
        """Add the peer's address (LLM-DataDist's Python spelling)."""
        self.remote_ip_infos.append(IpInfo(ip, port))

    def append_local_ip_info(self, ip: str, port: int) -> None:
        """Accepted for compatibility; kvflow binds the outgoing socket to ``ip`` if given."""
        self.local_ip_infos.append(IpInfo(ip, port))


@dataclass(frozen=True)
class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type``; ``shape[0]`` is blocks or batch."""

    num_tensors: int
    data_type: DataType
    shape: Sequence[int]
    placement: Placement = Placement.HOST

    @cached_property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor."""
        n = DataType(self.data_type).itemsize
        for d in self.shape:
            n *= int(d)
        return n

    @cached_property
    def stride(self) -> int:
        """Bytes of one block (or batch slot) of one tensor: ``tensor_bytes // shape[0]``."""
        return self.tensor_bytes // int(self.shape[0])

    @cached_property
    def num_blocks(self) -> int:
        """``shape[0]``: the number of blocks, or the batch size."""
        return int(self.shape[0])

    def validate(self) -> None:
        """Raise LLMParamInvalid unless the description is usable."""
        if not isinstance(self.num_tensors, int) or self.num_tensors <= 0:
            raise LLMParamInvalid(f"num_tensors must be a positive int, got {self.num_tensors!r}")
        try:
            DataType(self.data_type)
        except ValueError:
            raise LLMParamInvalid(f"unknown data_type {self.data_type!r}") from None
        if not self.shape or len(self.shape) >= 32:
            raise LLMParamInvalid(f"shape must have 1 to 31 dimensions, got {list(self.shape)!r}")
        if any((not isinstance(d, int)) or d <= 0 for d in self.shape):
            raise LLMParamInvalid(f"shape dimensions must be positive ints, got {list(self.shape)!r}")
        try:
            Placement(self.placement)
        except ValueError:
            raise LLMParamInvalid(f"unknown placement {self.placement!r}") from None


@dataclass(frozen=True)
class Cache:
    """A registered cache: its id, the address of each tensor and its description."""

    cache_id: int
    tensor_addrs: tuple[int, ...]
    cache_desc: CacheDesc


@dataclass(frozen=True)
class CacheIndex:
    """Names a cache on a peer: cluster id, cache id, batch index."""

    cluster_id: int
    cache_id: int
    batch_index: int = 0


LayerRange = Union[tuple[int, int], range]
#: A list of block indices: any sequence of ints, or a 1-D integer numpy array.
BlockList = Union[Sequence[int], "np.ndarray[Any, Any]"]


@dataclass(frozen=True)
class KvCacheExtParam:
    """Layer selection: inclusive ``(first, last)`` ranges or ``range``; ``(-1, -1)`` = all layers."""

    src_layer_range: LayerRange = (-1, -1)
    dst_layer_range: LayerRange = (-1, -1)
    tensor_num_per_layer: int = 2


Addr = Union[int, Any]
