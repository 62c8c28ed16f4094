"""Status codes (same numbers as LLM-DataDist) and the exception tree.

Exception tree::

    LLMException (RuntimeError)            .status_code: LLMStatusCode
    ├── LLMParamInvalid                    LLM_PARAM_INVALID: fix the call, never retry
    ├── LLMKvCacheNotExist                 LLM_KV_CACHE_NOT_EXIST: per request; the link stays healthy
    ├── LLMLinkStateError                  link state; (re)link or back off
    │   ├── LLMNotYetLink                  LLM_NOT_YET_LINK
    │   ├── LLMAlreadyLink                 LLM_ALREADY_LINK
    │   ├── LLMClusterNumExceedLimit       LLM_CLUSTER_NUM_EXCEED_LIMIT
    │   ├── LLMExistLink                   LLM_EXIST_LINK
    │   └── LLMLinkBusy                    LLM_LINK_BUSY
    ├── LLMLinkFailed                      LLM_LINK_FAILED: the link broke or could not be made
    ├── LLMUnlinkFailed                    LLM_UNLINK_FAILED
    ├── LLMTimeoutError (TimeoutError)     LLM_TIMEOUT
    ├── LLMWaitProcessTimeout (TimeoutError) LLM_WAIT_PROCESS_TIMEOUT
    ├── LLMFeatureNotEnabled               LLM_FEATURE_NOT_ENABLED
    ├── LLMOutOfMemory                     LLM_OUT_OF_MEMORY
    └── LLMFailed                          LLM_FAILED and any code without its own class
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import Any


class LLMStatusCode(IntEnum):
    """LLM-DataDist status codes, with the same numeric values."""

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
    LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_CACHE_INCOMPATIBLE = 0x5010B014
    LLM_CACHE_KEY_ALREADY_EXIST = 0x5010B015
    LLM_COPY_CACHE_FAILED = 0x5010B016
    LLM_CACHE_ID_ALREADY_EXIST = 0x5010B017
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C

    @classmethod
    def of(cls, value: int) -> LLMStatusCode:
        """The code for ``value``; unknown numbers map to LLM_FAILED."""
        try:
            return cls(value)
        except ValueError:
            return cls.LLM_FAILED


#: Codes a caller may retry after a pause (OmniInfer's production policy plus
#: KV_CACHE_NOT_EXIST, which LLM-DataDist documents as retryable).
RETRYABLE_CODES: frozenset[LLMStatusCode] = frozenset(
    {
        LLMStatusCode.LLM_REPEAT_REQUEST,
        LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
        LLMStatusCode.LLM_PROCESSING_LINK,
        LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
        LLMStatusCode.LLM_TIMEOUT,
        LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
        LLMStatusCode.LLM_LINK_BUSY,
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    }
)


class LLMException(RuntimeError):
    """Base of every kvflow error; ``status_code`` says which LLM-DataDist status it is."""

    default_code: LLMStatusCode = LLMStatusCode.LLM_FAILED

    def __init__(self, message: str = "", status_code: LLMStatusCode | None = None) -> None:
        self.status_code: LLMStatusCode = status_code if status_code is not None else self.default_code
        super().__init__(message or self.status_code.name)

    def __str__(self) -> str:
        return f"{self.status_code.name}: {self.args[0]}" if self.args else self.status_code.name

    def __reduce__(self) -> tuple[type[LLMException], tuple[Any, LLMStatusCode]]:  # keeps status_code in pickles
        return (type(self), (self.args[0] if self.args else "", self.status_code))


class LLMParamInvalid(LLMException):
    """A bad argument; raised before any byte moves or any peer is asked."""

    default_code = LLMStatusCode.LLM_PARAM_INVALID


class LLMKvCacheNotExist(LLMException):
    """The local or remote cache is not registered; the link stays healthy."""

    default_code = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


class LLMLinkStateError(LLMException):
    """The link is not in a state that allows the call."""


class LLMNotYetLink(LLMLinkStateError):
    """No usable link to that cluster: link first (or re-link a broken one)."""

    default_code = LLMStatusCode.LLM_NOT_YET_LINK


class LLMAlreadyLink(LLMLinkStateError):
    """A link to that cluster already exists."""

    default_code = LLMStatusCode.LLM_ALREADY_LINK


class LLMClusterNumExceedLimit(LLMLinkStateError):
    """More clusters in one (un)link call than allowed (16)."""

    default_code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT


class LLMExistLink(LLMLinkStateError):
    """Links still exist where the call needs none."""

    default_code = LLMStatusCode.LLM_EXIST_LINK


class LLMLinkBusy(LLMLinkStateError):
    """The link is busy with a conflicting operation."""

    default_code = LLMStatusCode.LLM_LINK_BUSY


class LLMLinkFailed(LLMException):
    """The link could not be made, or it broke (peer died, connection cut)."""

    default_code = LLMStatusCode.LLM_LINK_FAILED


class LLMUnlinkFailed(LLMException):
    """Unlink could not be completed on the peer."""

    default_code = LLMStatusCode.LLM_UNLINK_FAILED


class LLMTimeoutError(LLMException, TimeoutError):
    """A transfer or control request passed its deadline (LLM_TIMEOUT)."""

    default_code = LLMStatusCode.LLM_TIMEOUT


class LLMWaitProcessTimeout(LLMException, TimeoutError):
    """Waiting for the peer to process a request timed out (LLM_WAIT_PROCESS_TIMEOUT)."""

    default_code = LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT


class LLMFeatureNotEnabled(LLMException):
    """The feature or transport is not available here."""

    default_code = LLMStatusCode.LLM_FEATURE_NOT_ENABLED


class LLMOutOfMemory(LLMException):
    """Out of memory or over a configured memory bound."""

    default_code = LLMStatusCode.LLM_OUT_OF_MEMORY


class LLMFailed(LLMException):
    """Generic failure (LLM_FAILED)."""

    default_code = LLMStatusCode.LLM_FAILED


_CLASS_BY_CODE: dict[LLMStatusCode, type[LLMException]] = {
    cls.default_code: cls
    for cls in (
        LLMParamInvalid,
        LLMKvCacheNotExist,
        LLMNotYetLink,
        LLMAlreadyLink,
        LLMClusterNumExceedLimit,
        LLMExistLink,
        LLMLinkBusy,
        LLMLinkFailed,
        LLMUnlinkFailed,
        LLMTimeoutError,
        LLMWaitProcessTimeout,
        LLMFeatureNotEnabled,
        LLMOutOfMemory,
        LLMFailed,
    )
}


def error_for(code: int, message: str = "") -> LLMException:
    """The most specific exception for a status code (for codes that come off the wire)."""
    status = LLMStatusCode.of(code)
    cls = _CLASS_BY_CODE.get(status, LLMException)
    return cls(message, status)


class LinkResults(list[LLMStatusCode]):
    """What ``link_llm_clusters`` returns: one status per cluster, in the order asked (a plain list
    of codes to code that expects one), and in ``errors``, by remote cluster id, the exception for
    each cluster that did not link: its ``status_code`` and a message that says what happened
    ("listener backlog full: ... retried 7 times over 0.98 s until the timeout")."""

    errors: dict[int, LLMException]

    def __init__(self, codes: Iterable[LLMStatusCode] = (), errors: dict[int, LLMException] | None = None) -> None:
        super().__init__(codes)
        self.errors = errors if errors is not None else {}

    def __repr__(self) -> str:
        if not self.errors:
            return super().__repr__()
        return f"LinkResults({super().__repr__()}, errors={self.errors!r})"

    def __reduce__(self) -> tuple[type[LinkResults], tuple[list[LLMStatusCode], dict[int, LLMException]]]:
        return (type(self), (list(self), self.errors))
