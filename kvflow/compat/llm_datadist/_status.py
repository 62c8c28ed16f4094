"""Status codes, :class:`Status`, the original's argument checks, and the small enums and types
of :mod:`kvflow.compat.llm_datadist`."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, IntEnum
from typing import Any, NoReturn

from ..._status import LLMFeatureNotEnabled, LLMParamInvalid
from ..._types import LlmRole

_UINT16 = (1 << 16) - 1
_UINT32 = (1 << 32) - 1
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (1 << 64) - 1
_INVALID_ID = _UINT64
_TENSORS_PER_LAYER = 2
_DEFAULT_SYNC_KV_TIMEOUT_MS = "1000"  # LLM-DataDist's default (kvflow's own is 5000)

LLMRole = LlmRole
"""``PROMPT = 1``, ``DECODER = 2``, ``MIX = 3``: a label only (kvflow's :class:`kvflow.LlmRole`)."""


# ---------------------------------------------------------------------- status codes
class LLMStatusCode(IntEnum):
    """The original's status names and numbers; equal, as ints, to :class:`kvflow.LLMStatusCode`
    (so ``exc.status_code == LLMStatusCode.LLM_TIMEOUT`` holds for kvflow's errors)."""

    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053  # ACL_ERROR_RT_DEVICE_MEM_ERROR
    LLM_SUSPECT_REMOTE_ERROR = 507057  # ACL_ERROR_RT_SUSPECT_REMOTE_ERROR
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


def _code(value: int) -> LLMStatusCode:
    """The status for a number; unknown numbers are LLM_FAILED (the original's ``code_2_status``)."""
    try:
        return LLMStatusCode(int(value))
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class Status:
    """A status code with ``is_ok()``."""

    def __init__(self, status: int) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        """Whether the status is LLM_SUCCESS."""
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> int:
        """The code."""
        return self._status_code


def _invalid(message: str) -> NoReturn:
    """The original's ``raise_if_false``: LLMException with LLM_PARAM_INVALID."""
    raise LLMParamInvalid(message)


def _unsupported(what: str, why: str) -> NoReturn:
    raise LLMFeatureNotEnabled(f"{what} is not supported by kvflow.compat.llm_datadist: {why} (docs/compat.md)")


class _V1NotSupported(LLMFeatureNotEnabled, AttributeError):
    """A V1 name was asked for: LLM_FEATURE_NOT_ENABLED, and an AttributeError for ``hasattr``."""


# ---------------------------------------------------------------------- argument checks (TypeError/ValueError)
def _check_type(name: str, value: Any, classes: type | tuple[type, ...], inner: type | None = None,
                allow_none: bool = True) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, classes):
        names = [c.__name__ for c in (classes if isinstance(classes, tuple) else (classes,))]
        raise TypeError(f"{name} only support {names}, but got {type(value)}.")
    if inner is not None:
        assert isinstance(value, Iterable), "inner types are checked only in containers"
        for v in value:
            if not isinstance(v, inner) or (inner is int and isinstance(v, bool)):
                raise TypeError(f"{name} inner type only support [{inner.__name__}], but got {type(v)}.")


def _check_range(name: str, value: Any, lo: int, hi: int, kind: str) -> int:
    _check_type(name, value, int, allow_none=False)
    if not lo <= value <= hi:
        raise ValueError(f"{name}'s value is out of range,{value} is not a {kind} value.")
    return int(value)


def _uint16(name: str, value: Any) -> int:
    return _check_range(name, value, 0, _UINT16, "uint16")


def _uint32(name: str, value: Any) -> int:
    return _check_range(name, value, 0, _UINT32, "uint32")


def _int32(name: str, value: Any) -> int:
    return _check_range(name, value, *_INT32, "int32")


def _int64(name: str, value: Any) -> int:
    return _check_range(name, value, *_INT64, "int64")


def _uint64(name: str, value: Any) -> int:
    return _check_range(name, value, 0, _UINT64, "uint64")


# ---------------------------------------------------------------------- enums and small types
class DataType(Enum):
    """Element types, with GE's numbers (those of :class:`kvflow.DataType`, plus ``DT_STRING``,
    which has no fixed size and is refused at registration)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13


class RegisterMemStatus(Enum):
    """Status of a comm-domain ``link()`` (not supported here)."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    """Memory kind of a :class:`MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """A memory range, for ``remap_registered_memory`` (not supported here)."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        _check_type("mem_type", mem_type, Memtype, allow_none=False)
        _check_type("addr", addr, int, allow_none=False)
        _check_type("size", size, int, allow_none=False)
        self.mem_type, self.addr, self.size = mem_type, addr, size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self.mem_type}, addr={self.addr}, size={self.size})"
