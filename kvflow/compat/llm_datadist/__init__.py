"""``llm_datadist`` on kvflow: the V2 (CacheManager) Python API of Huawei's LLM-DataDist package.

Code written for ``llm_datadist`` runs after changing one import line::

    import kvflow.compat.llm_datadist as llm_datadist
    # or, before the first import of llm_datadist:
    sys.modules["llm_datadist"] = kvflow.compat.llm_datadist

The names, argument orders, defaults and type checks are those of the original package (hicann/hixl,
``src/python/llm_datadist``); every call blocks, as there. Underneath is one
:class:`kvflow.sync.LlmDataDist` per :class:`LLMDataDist`. What is supported, ignored or refused
with a typed error is listed name by name in docs/compat.md.
"""

from __future__ import annotations

from typing import Any

from ..._layerwise import LayerSynchronizer
from ..._status import LLMException
from ..._types import Placement
from ._caches import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from ._config import IGNORED_OPTIONS as IGNORED_OPTIONS
from ._config import LLMClusterInfo, LLMConfig, LlmConfig
from ._config import _settings as _settings
from ._datadist import LLMDataDist
from ._manager import CacheManager
from ._status import (
    DataType,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    RegisterMemStatus,
    Status,
    _V1NotSupported,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "KvCache",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]


def __getattr__(name: str) -> Any:
    if name in ("TensorDesc", "Tensor", "KvCacheManager"):
        raise _V1NotSupported(f"{name} is not supported by kvflow.compat.llm_datadist: it belongs to the V1 "
                              "KvCacheManager API (docs/compat.md)")
    raise AttributeError(f"Module 'llm_datadist' has no attribute '{name}'")
