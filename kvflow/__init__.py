"""kvflow: move LLM KV cache between prefill and decode workers, from asyncio."""

from __future__ import annotations

from ._datadist import LinkInfo, LlmDataDist
from ._discovery import available_transports
from ._layerwise import CacheTask, LayerEvents, LayerSynchronizer, TransferConfig
from ._run import run
from ._status import (
    RETRYABLE_CODES,
    LinkResults,
    LLMAlreadyLink,
    LLMClusterNumExceedLimit,
    LLMException,
    LLMExistLink,
    LLMFailed,
    LLMFeatureNotEnabled,
    LLMKvCacheNotExist,
    LLMLinkBusy,
    LLMLinkFailed,
    LLMLinkStateError,
    LLMNotYetLink,
    LLMOutOfMemory,
    LLMParamInvalid,
    LLMStatusCode,
    LLMTimeoutError,
    LLMUnlinkFailed,
    LLMWaitProcessTimeout,
)
from ._types import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmRole,
    Placement,
)

__version__ = "0.1.0"

__all__ = (
    "RETRYABLE_CODES",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CacheTask",
    "ClusterInfo",
    "DataType",
    "IpInfo",
    "KvCacheExtParam",
    "LLMAlreadyLink",
    "LLMClusterNumExceedLimit",
    "LLMException",
    "LLMExistLink",
    "LLMFailed",
    "LLMFeatureNotEnabled",
    "LLMKvCacheNotExist",
    "LLMLinkBusy",
    "LLMLinkFailed",
    "LLMLinkStateError",
    "LLMNotYetLink",
    "LLMOutOfMemory",
    "LLMParamInvalid",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LLMUnlinkFailed",
    "LLMWaitProcessTimeout",
    "LayerEvents",
    "LayerSynchronizer",
    "LinkInfo",
    "LinkResults",
    "LlmDataDist",
    "LlmRole",
    "Placement",
    "TransferConfig",
    "__version__",
    "available_transports",
    "run",
)

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and getattr(_obj, "__module__", "").startswith("kvflow._"):
        try:
            _obj.__module__ = "kvflow"
        except (AttributeError, TypeError):
            pass
del _name, _obj
