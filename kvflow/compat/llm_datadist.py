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

import atexit
import logging
import socket
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, NoReturn

from .. import sync as _sync
from .._layerwise import LayerSynchronizer
from .._layerwise import TransferConfig as _KvTransferConfig
from .._options import parse_options
from .._status import (
    LLMException,
    LLMExistLink,
    LLMFailed,
    LLMFeatureNotEnabled,
    LLMNotYetLink,
    LLMParamInvalid,
)
from .._types import Cache as _KvCache
from .._types import CacheDesc as _KvCacheDesc
from .._types import CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam, LlmRole, Placement
from .._types import DataType as _KvDataType
from ._placement import resolve_placement

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

log = logging.getLogger("kvflow.compat.llm_datadist")

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


def _ip_to_int(ip: str | int) -> int:
    """The original's encoding: ``inet_aton`` bytes read as a little-endian int (ints pass through)."""
    if isinstance(ip, str):
        try:
            return int.from_bytes(socket.inet_aton(ip), "little")
        except OSError:
            raise RuntimeError(f"Can not parse ip str:{ip}") from None
    return _uint32("ip", ip)


def _int_to_ip(ip: int) -> str:
    return socket.inet_ntoa(int(ip).to_bytes(4, "little"))


class LLMClusterInfo:
    """A peer to link to: ``remote_cluster_id`` and its listen address (``append_remote_ip_info``)."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (any uint64, 0 included)."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = _uint64("remote_cluster_id", value)

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """Accepted and ignored (roles are labels)."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        _check_type("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """(ip as a little-endian int, port) pairs; ignored by kvflow (it dials from any local address)."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """(ip as a little-endian int, port) pairs: where the peer listens (exactly one to link)."""
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address (``ip``: dotted IPv4 string, or the int the original's encoding gives)."""
        _check_type("ip", ip, (str, int), allow_none=False)
        _uint16("port", port)
        self._local_ip_info_list.append((_ip_to_int(ip), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the peer's listen address (``ip``: dotted IPv4 string, or the original's int encoding)."""
        _check_type("ip", ip, (str, int), allow_none=False)
        _uint16("port", port)
        self._remote_ip_info_list.append((_ip_to_int(ip), port))

    def _kvflow(self) -> ClusterInfo:
        if self._remote_cluster_id is None:
            raise TypeError("remote_cluster_id only support ['int'], but got <class 'NoneType'>.")
        return ClusterInfo(self._remote_cluster_id, [IpInfo(_int_to_ip(ip), port)
                                                     for ip, port in self._remote_ip_info_list])


# ---------------------------------------------------------------------- LLMConfig
#: Options of the original that have no meaning on kvflow: accepted and ignored (docs/compat.md).
IGNORED_OPTIONS = frozenset({
    "llm.EnableCacheManager", "llm.EnableRemoteCacheAccessible", "llm.LocalCommRes", "llm.TransferBackend",
    "llm.GlobalResourceConfig", "llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.BufPoolCfg",
    "llm.LinkTotalTime", "llm.LinkRetryCount", "llm.RdmaTrafficClass", "llm.RdmaServiceLevel",
    "llm.EnableSwitchRole", "llm.MemoryUtilization", "llm.OutputMaxSize", "llm.ClusterInfo",
    "llm.deployResPath", "llm.Role", "ge.flowGraphMemMaxSize",
})
_LISTEN_KEYS = ("llm.ListenIpInfo", "llm.listenIpInfo")
_DEVICE_KEYS = ("llm.DeviceId", "ge.session_device_id", "ge.exec.deviceId")


class LlmConfig:
    """Builds the options of :meth:`LLMDataDist.init`: the original's attributes and checks.

    :meth:`generate_options` spells the options that mean something here as kvflow does
    (``llm.ListenIpInfo``, ``llm.SyncKvCacheWaitTime``, ``llm.DeviceId``) and keeps the others under
    the original's keys, which :meth:`LLMDataDist.init` accepts and ignores."""

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._listen_ip_info = ""
        self._sync_kv_timeout: int | str | None = None
        self._deploy_res_path = ""
        self._ge_options: dict[str, str] = {}
        self._enable_switch_role = False
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._cluster_info = ""
        self._output_max_size: int | None = None
        self._mem_utilization = 0.95
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None

    def generate_options(self) -> dict[str, str]:
        """The options dict for :meth:`LLMDataDist.init`."""
        return self.gen_options()

    def gen_options(self) -> dict[str, str]:
        """Same as :meth:`generate_options`."""
        opts = self._options
        opts.update(self._ge_options)
        if self._device_id is not None:
            first = self._device_id if isinstance(self._device_id, int) else self._device_id[0]
            opts["llm.DeviceId"] = str(first)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._listen_ip_info:
            opts["llm.ListenIpInfo"] = self._listen_ip_info
        for key, value in (("llm.deployResPath", self._deploy_res_path), ("llm.BufPoolCfg", self._buf_pool_cfg),
                           ("llm.MemPoolConfig", self._mem_pool_cfg),
                           ("llm.HostMemPoolConfig", self._host_mem_pool_cfg), ("llm.ClusterInfo", self._cluster_info)):
            if value:
                opts[key] = str(value)
        for key, flag in (("llm.EnableCacheManager", self._enable_cache_manager),
                          ("llm.EnableRemoteCacheAccessible", self._enable_remote_cache_accessible)):
            if flag is not None:
                opts[key] = "1" if flag else "0"
        for key, num in (("llm.LinkTotalTime", self._link_total_time), ("llm.LinkRetryCount", self._link_retry_count),
                         ("llm.RdmaTrafficClass", self._rdma_traffic_class),
                         ("llm.RdmaServiceLevel", self._rdma_service_level),
                         ("llm.OutputMaxSize", self._output_max_size)):
            if num is not None:
                opts[key] = str(num)
        for key, text in (("llm.LocalCommRes", self._local_comm_res), ("llm.TransferBackend", self._transfer_backend),
                          ("llm.GlobalResourceConfig", self._global_resource_config)):
            if text is not None:
                opts[key] = text
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    @property
    def options(self) -> dict[str, str]:
        """The options generated so far."""
        return self._options

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra options copied into the result as they are."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        _check_type("ge_options", value, dict)
        for k, v in value.items():
            _check_type("ge_options key", k, str, allow_none=False)
            _check_type("ge_options value", v, str, allow_none=False)
        self._ge_options = value

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Accepted (``llm.DeviceId``, the first one of a list) and unused."""
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        _check_type("device_id", value, (list, tuple, int))
        for dev in (value if isinstance(value, (list, tuple)) else [value]):
            _int32("device_id", dev)
            if dev < 0:
                _invalid("device_id should be greater than or equal to zero.")
        self._device_id = value

    @property
    def listen_ip_info(self) -> str:
        """``"ip:port"`` to accept links on (``llm.ListenIpInfo``); port 0 picks a free one."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        _check_type("listen_ip_info", value, str)
        self._listen_ip_info = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Deadline of each pull/push in ms (``llm.SyncKvCacheWaitTime``; default 1000, as in the original)."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        _check_type("sync_kv_timeout", value, (int, str))
        if isinstance(value, str) and not value.isdigit():
            _invalid("sync_kv_timeout must be digit.")
        if int(value) <= 0:
            _invalid("sync_kv_timeout should be greater than zero.")
        _int32("sync_kv_timeout", int(value))
        self._sync_kv_timeout = value

    @property
    def deploy_res_path(self) -> str:
        """Ignored."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str) -> None:
        _check_type("deploy_res_path", value, str)
        self._deploy_res_path = value

    @property
    def buf_pool_cfg(self) -> str:
        """Ignored (V1 memory pool)."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str) -> None:
        _check_type("buf_pool_cfg", value, str)
        self._buf_pool_cfg = value

    @property
    def output_max_size(self) -> int | None:
        """Ignored."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        _check_type("output_max_size", value, int)
        self._output_max_size = value

    @property
    def mem_utilization(self) -> float:
        """Ignored."""
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        _check_type("mem_utilization", value, float)
        if not 0.0 <= value <= 1.0:
            _invalid(f"mem_utilization must be in range [0,1], current:{value}")
        self._mem_utilization = value

    @property
    def cluster_info(self) -> str:
        """Ignored."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        _check_type("cluster_info", value, str)
        self._cluster_info = value

    @property
    def enable_switch_role(self) -> bool:
        """Ignored: :meth:`LLMDataDist.switch_role` always works."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        _check_type("enable_switch_role", value, bool)
        self._enable_switch_role = value

    @property
    def link_total_time(self) -> int:
        """Ignored (HCCL); the ``timeout`` of ``link_clusters`` bounds a link."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        _check_type("link_total_time", value, int)
        if not 0 <= value <= _UINT32:
            _invalid(f"link_total_time should be an integer between [0, 2^32-1], given value is {value}")
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        """Ignored (HCCL)."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        _check_type("link_retry_count", value, int)
        if not 1 <= value <= 100:
            _invalid(f"link_retry_count should be an integer between [1, 100], given value is {value}")
        self._link_retry_count = value

    @property
    def enable_cache_manager(self) -> bool:
        """Ignored: kvflow always runs the CacheManager (V2) API."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        _check_type("enable_cache_manager", value, bool)
        self._enable_cache_manager = value

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Selects, as in the original, which calls are allowed: push_*, and the key types of pull_cache
        and transfer_cache_async. Every registered cache is reachable by linked peers either way."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        _check_type("enable_remote_cache_accessible", value, bool)
        self._enable_remote_cache_accessible = value

    @property
    def mem_pool_cfg(self) -> str:
        """Ignored (only the deprecated ``allocate_*`` used the pool)."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        _check_type("mem_pool_cfg", value, str)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        """Ignored."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        _check_type("host_mem_pool_cfg", value, str)
        self._host_mem_pool_cfg = value

    @property
    def rdma_traffic_class(self) -> int | None:
        """Ignored."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._rdma_traffic_class = _uint32("rdma_traffic_class", value)

    @property
    def rdma_service_level(self) -> int | None:
        """Ignored."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._rdma_service_level = _uint32("rdma_service_level", value)

    @property
    def local_comm_res(self) -> str:
        """Ignored, except that setting it turns remote cache access on by default, as in the original."""
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, value: str) -> None:
        _check_type("local_comm_res", value, str)
        self._local_comm_res = value

    @property
    def transfer_backend(self) -> str:
        """Ignored (kvflow picks its transport; see ``kvflow.Transports``); the original's checks apply."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, value: str) -> None:
        _check_type("transfer_backend", value, str)
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        """Ignored."""
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, value: str) -> None:
        _check_type("global_resource_config", value, str)
        self._global_resource_config = value


LLMConfig = LlmConfig


@dataclass(frozen=True)
class _Settings:
    """What :meth:`LLMDataDist.init` made of the options."""

    kvflow_options: dict[str, str]
    listen: str | None
    remote_cache_accessible: bool
    require_local_ip: bool


def _listen_of(options: Mapping[str, str]) -> str | None:
    for key in _LISTEN_KEYS:
        if key in options:
            return str(options[key])
    if "llm.ListenIp" in options and "llm.ListenPort" in options:
        return f"{options['llm.ListenIp']}:{options['llm.ListenPort']}"
    return None


def _settings(options: Mapping[str, Any]) -> _Settings:
    """Translate the original's options (either spelling) into kvflow's; apply the original's rules."""
    _check_type("options", options, dict, allow_none=False)
    kv: dict[str, str] = {"llm.SyncKvCacheWaitTime": _DEFAULT_SYNC_KV_TIMEOUT_MS}
    ignored = []
    for key, value in options.items():
        if key in _LISTEN_KEYS or key in _DEVICE_KEYS or key in ("llm.ListenIp", "llm.ListenPort"):
            continue
        if key == "llm.SyncKvCacheWaitTime" or (isinstance(key, str) and key.startswith("kvflow.")):
            kv[key] = str(value)
        else:
            ignored.append(key)
    listen = _listen_of(options)
    if listen is not None:
        kv["llm.ListenIpInfo"] = listen
    device = next((str(options[k]).split(";")[0] for k in _DEVICE_KEYS if k in options), None)
    if device is not None:
        kv["llm.DeviceId"] = device
    if ignored:
        log.info("llm_datadist options without meaning on kvflow, ignored: %s", ", ".join(map(str, ignored)))
    local_comm_res = options.get("llm.LocalCommRes")
    remote = options.get("llm.EnableRemoteCacheAccessible")
    if remote is None and (local_comm_res is not None or "llm.TransferBackend" in options):
        remote = "1"  # the original turns it on when local_comm_res or a transfer backend is set
    if "llm.TransferBackend" in options:
        if remote != "1":
            _invalid("llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible is not enable.")
        if listen is None:
            _invalid("llm.TransferBackend is not supported when llm.listenIpInfo is not configured.")
    return _Settings(kv, listen, remote == "1", not local_comm_res)


# ---------------------------------------------------------------------- cache types
class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type``; ``shape[batch_dim_index]`` is the
    number of blocks (blocks cache) or the batch size. ``placement`` is a hint (docs/compat.md)."""

    def __init__(self, num_tensors: int, shape: list[int] | tuple[int, ...], data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0, seq_len_dim_index: int = -1,
                 kv_tensor_format: str | None = None) -> None:
        _uint32("num_tensors", num_tensors)
        _check_type("shape", shape, (tuple, list), int)
        _check_type("data_type", data_type, DataType)
        _check_type("placement", placement, Placement)
        _check_type("batch_dim_index", batch_dim_index, int)
        _int32("seq_len_dim_index", seq_len_dim_index)
        _check_type("kv_tensor_format", kv_tensor_format, str)
        if not 0 <= batch_dim_index < len(shape):
            _invalid(f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})")
        if not (seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape)):
            _invalid(f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range [0, {len(shape)})")
        for d in shape:
            _int64("shape", d)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, data_type={self._data_type}, "
                f"placement={self._placement}, batch_dim_index={self._batch_dim}, "
                f"seq_len_dim_index={self._seq_len_dim_index},kv_tensor_format={self._kv_tensor_format})")

    @property
    def num_tensors(self) -> int:
        """Number of tensors."""
        return self._num_tensors

    @property
    def shape(self) -> list[int] | tuple[int, ...]:
        """Shape of one tensor."""
        return self._shape

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Change one dimension of ``shape`` (before registering)."""
        self._shape[dim_index] = dim_value  # type: ignore[index]

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Declared placement (a hint, see docs/compat.md)."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """Index of the batch (blocks) dimension."""
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim]``."""
        return self._shape[self._batch_dim]

    @property
    def seq_len_dim_index(self) -> int:
        """Accepted and unused."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Accepted and unused."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        n = _kv_dtype(self._data_type).itemsize
        for d in self._shape:
            n *= d
        return n

    def _kvflow(self, placement: Placement) -> _KvCacheDesc:
        """kvflow's description: the same bytes, with the batch (blocks) dimension first."""
        shape = list(self._shape)
        if self._batch_dim != 0:
            rest = 1
            for i, d in enumerate(shape):
                if i != self._batch_dim:
                    rest *= d
            shape = [shape[self._batch_dim], rest]
        return _KvCacheDesc(self._num_tensors, _kv_dtype(self._data_type), shape, placement)


def _kv_dtype(data_type: DataType) -> _KvDataType:
    try:
        return _KvDataType(data_type.value)
    except ValueError:
        raise LLMParamInvalid(f"data_type {data_type} has no fixed element size") from None


class Cache:
    """A registered cache: returned by ``register_cache``/``register_blocks_cache``, not built by hand
    (except :meth:`create_cpu_cache`, which registers nothing)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int], cache_manager: Any = None,
                 is_registered: bool = True, is_blocks_cache: bool = False) -> None:
        self._cache_id = _int64("cache_id", cache_id)
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache

    @property
    def cache_id(self) -> int:
        """Its id (ids start at 1); -1 for :meth:`create_cpu_cache`."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Its description, as given."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """The address of each tensor."""
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        """Registered with ``register_blocks_cache``."""
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """A host-memory description for the deprecated ``swap_blocks`` (which kvflow refuses)."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int)
        if cache_desc.placement != Placement.HOST:
            _invalid("cache_desc placement must be HOST")
        if cache_desc.num_tensors != len(addrs):
            _invalid(f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}")
        return cls(-1, cache_desc, addrs, None, False, True)

    def __repr__(self) -> str:
        return (f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = {len(self._tensor_addrs)}, "
                f"is_blocks_cache = {self._is_blocks_cache})")


class KvCache:
    """The V1 ``KvCacheManager``'s cache: not supported (kvflow implements the V2 API)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("KvCache", "it belongs to the V1 KvCacheManager API")


class BlocksCacheKey:
    """Names a peer's blocks cache: ``BlocksCacheKey(cluster_id, model_id=0)`` (or ``prompt_cluster_id=``).

    At registration only ``model_id`` counts (it becomes the kvflow key of the cache); in a transfer
    ``cluster_id`` says which peer, and the link resolves ``model_id`` to that peer's cache."""

    def __init__(self, *args: int, **kwargs: int) -> None:
        if len(args) + len(kwargs) > 2:
            _invalid("Param num is over limit")
        if args:
            kwargs["cluster_id"] = args[0]
        if len(args) > 1:
            kwargs["model_id"] = args[1]
        if "prompt_cluster_id" not in kwargs and "cluster_id" not in kwargs:
            _invalid("Param prompt_cluster_id or cluster_id is required")
        for k in kwargs:
            if k not in ("prompt_cluster_id", "cluster_id", "model_id"):
                _invalid(f"Unsupported param:{k}")
        self._key_name = "cluster_id" if "cluster_id" in kwargs else "prompt_cluster_id"
        self._cluster_id = kwargs[self._key_name]
        self._model_id = kwargs.get("model_id", 0)
        _check_type("cluster_id", self._cluster_id, int, allow_none=False)
        _check_type("model_id", self._model_id, int, allow_none=False)

    @property
    def cluster_id(self) -> int:
        """The peer that holds the cache (ignored at registration)."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Which of that peer's blocks caches."""
        return self._model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._key_name}={self._cluster_id}, model_id={self._model_id})"


class CacheKey:
    """A cache named by request (``req_id``) or prefix: accepted as a value, refused by every call
    (kvflow names caches by id or by ``BlocksCacheKey``)."""

    def __init__(self, *args: int, **kwargs: int) -> None:
        if len(args) + len(kwargs) > 4:
            _invalid("Param num is over limit")
        for name, value in zip(("cluster_id", "req_id", "model_id", "prefix_id"), args):
            kwargs[name] = value
        if "prompt_cluster_id" not in kwargs and "cluster_id" not in kwargs:
            _invalid("Param prompt_cluster_id or cluster_id is required")
        if "req_id" not in kwargs:
            _invalid("Param req_id is required")
        for k in kwargs:
            if k not in ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"):
                _invalid(f"Unsupported param:{k}")
        self._cluster_id = _uint64("cluster_id", kwargs.get("cluster_id", kwargs.get("prompt_cluster_id")))
        self._req_id = _uint64("req_id", kwargs["req_id"])
        self._model_id = _uint64("model_id", kwargs.get("model_id", 0))
        self._prefix_id = _uint64("prefix_id", kwargs.get("prefix_id", _INVALID_ID))

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id."""
        return self._req_id

    @property
    def prefix_id(self) -> int:
        """Prefix id (2**64-1: none)."""
        return self._prefix_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, prefix_id={self._prefix_id}, "
                f"model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """Names one batch slot of a peer's cache: ``(cluster_id, cache_id, batch_index=0)``."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = _uint64("cluster_id", cluster_id)
        self._cache_id = _int64("cache_id", cache_id)
        self._batch_index = _uint32("batch_index", batch_index)

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """The id the peer's ``register_*`` returned."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """The slot."""
        return self._batch_index

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")


def _check_layer_range(name: str, value: Any, allow_none: bool = True) -> None:
    if allow_none and value is None:
        return
    _check_type(name, value, range, allow_none=allow_none)
    if value.step != 1:
        _invalid(f"check {name}.step == 1 failed")
    if not 0 <= value.start < value.stop:
        _invalid(f"check 0 <= range.start < range.stop failed, {name} = {value}")


class TransferWithCacheKeyConfig:
    """One destination of ``transfer_cache_async``: a peer's cache (``BlocksCacheKey`` or
    ``CacheKeyByIdAndIndex``), the source and destination layers (``range``s of equal length) and the
    source slot."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex, src_layer_range: range | None = None,
                 dst_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        _check_type("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False)
        _check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        _check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        if len(src_layer_range) != len(dst_layer_range):
            _invalid("src_layer_range size should be equal to dst_layer_range size")
        _uint32("src_batch_index", src_batch_index)
        if isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0:
            _invalid("src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self.cache_key}, src_layer_range={self.src_layer_range}, "
                f"dst_layer_range={self.dst_layer_range}, src_batch_index={self.src_batch_index})")


class TransferConfig:
    """A destination given by raw peer addresses: accepted as a value, refused by
    ``transfer_cache_async`` (kvflow reaches a peer's memory only through its registered caches)."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int], src_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        _uint64("dst_cluster_id", dst_cluster_id)
        _check_type("dst_addrs", dst_addrs, (list, tuple), int, allow_none=False)
        _check_layer_range("src_layer_range", src_layer_range)
        _uint32("src_batch_index", src_batch_index)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self.dst_cluster_id}, dst_addrs={self.dst_addrs}, "
                f"src_layer_range={self.src_layer_range}, src_batch_index={self.src_batch_index})")


class CacheTask:
    """A running ``transfer_cache_async``: ``synchronize`` and ``get_results`` wait (at most
    ``timeout_in_millis``, else until it ends); a wait that times out leaves the transfer running."""

    def __init__(self, task: _sync.CacheTask | None, slots: list[int | None],
                 early: dict[int, LLMStatusCode]) -> None:
        self._task = task
        self._slots = slots  # per config: its index in the kvflow task, or None (failed before it started)
        self._early = early  # per config index: the status it failed with before the task started

    def _wait(self, timeout_in_millis: int | None) -> bool:
        """Whether the task has ended (waiting at most ``timeout_in_millis``)."""
        if timeout_in_millis is not None:
            _uint32("timeout_in_millis", timeout_in_millis)
        if self._task is None or self._task.done():
            return True
        self._task.synchronize(timeout_in_millis)
        return self._task.done()

    def _results(self) -> list[LLMStatusCode | None]:
        got = self._task.get_results() if self._task is not None else []
        out: list[LLMStatusCode | None] = []
        for i, slot in enumerate(self._slots):
            if slot is None:
                out.append(self._early[i])
            else:
                r = got[slot]
                out.append(None if r is None else _code(r))
        return out

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """LLM_SUCCESS, the first failed config's status, or LLM_TIMEOUT if the task still runs."""
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results():
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        err = self._task.exception() if self._task is not None else None
        return _code(err.status_code) if err is not None else LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per config (None: none of its layers was sent); all LLM_TIMEOUT if the task
        still runs after the wait."""
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._slots)
        return self._results()

    @property
    def kvflow_task(self) -> _sync.CacheTask | None:
        """The underlying :class:`kvflow.sync.CacheTask` (progress, ``cancel()``); kvflow extension."""
        return self._task


# ---------------------------------------------------------------------- layer ranges
def _inclusive(rng: range) -> tuple[int, int]:
    return rng.start, rng.stop - 1


def _check_per_layer(what: str, n: Any, num_tensors: int) -> int:
    _uint32("tensor_num_per_layer", n)
    if n <= 0:
        _invalid(f"[{what}] param check failed, tensor_num_per_layer ({n}) is invalid, should [1, {num_tensors}]")
    return int(n)


def _pull_ext(src: range | None, dst: range | None, n: int, local_tensors: int) -> KvCacheExtParam | None:
    """Layers of a pull. None for both: every layer. One None: dst takes all local layers; src
    starts at layer 0 with dst's length (as the original's native side reads it)."""
    for name, rng in (("src_layer_range", src), ("dst_layer_range", dst)):
        if rng is not None:
            _check_type(name, rng, range)
            if rng.step != 1:
                _invalid(f"param check failed, {name} step must be 1.")
            if len(rng) and rng.start < 0:
                _invalid(f"{name} is invalid, the start value:{rng.start} is < 0")
    if src is None and dst is None:
        return None if n == _TENSORS_PER_LAYER else KvCacheExtParam(tensor_num_per_layer=n)
    if dst is None:
        dst = range(0, local_tensors // n)
    if src is None:
        src = range(0, len(dst))
    if not len(src) or not len(dst):
        _invalid("layer ranges must not be empty")
    return KvCacheExtParam(_inclusive(src), _inclusive(dst), n)


def _push_ext(src: range | None, dst: range | None, n: int, src_tensors: int) -> KvCacheExtParam:
    """Layers of a push: None is every layer of the source cache, on both sides (the original's default)."""
    _check_layer_range("src_layer_range", src)
    _check_layer_range("dst_layer_range", dst)
    layers = src_tensors // n
    src = range(0, layers) if src is None else src
    dst = range(0, layers) if dst is None else dst
    if len(src) != len(dst):
        _invalid("src_layer_range size should be equal to size of dst_layer_range size.")
    if not len(src):
        _invalid(f"the source cache has no whole layer of {n} tensors")
    return KvCacheExtParam(_inclusive(src), _inclusive(dst), n)


def _blocks(name: str, value: Any) -> list[int]:
    _check_type(name, value, (list, tuple), int)
    return list(value) if value is not None else []


# ---------------------------------------------------------------------- CacheManager
@dataclass
class _Registered:
    """What a registration needs to be made again (``switch_role`` restarts the kvflow instance)."""

    cache: _KvCache
    key: int | None


class CacheManager:
    """Registers caches and moves them: ``datadist.cache_manager``. Every call blocks."""

    def __init__(self, owner: LLMDataDist) -> None:
        self._owner = owner

    # ------------------------------------------------------------------ registration
    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register a contiguous (batch) cache: ``len(addrs) == num_tensors`` int addresses.
        ``cache_keys`` must be empty (CacheKey is not supported); ``remote_accessible`` is ignored."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int, allow_none=False)
        _check_type("cache_keys", cache_keys, (tuple, list), CacheKey)
        _check_type("remote_accessible", remote_accessible, bool)
        if cache_keys:
            _unsupported("register_cache(cache_keys=...)", "kvflow names a cache by its id; peers use "
                         "CacheKeyByIdAndIndex")
        return self._register("register_cache", cache_desc, addrs, None)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register a blocks (PagedAttention) cache: ``shape[0]`` is the number of blocks. With
        ``blocks_cache_key``, peers find it by ``BlocksCacheKey(<this cluster>, model_id)``
        (one cache per model_id at a time); ``remote_accessible`` is ignored."""
        _check_type("cache_desc", cache_desc, CacheDesc, allow_none=False)
        _check_type("addrs", addrs, list, int, allow_none=False)
        _check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        _check_type("remote_accessible", remote_accessible, bool)
        key = None if blocks_cache_key is None else _uint64("model_id", blocks_cache_key.model_id)
        return self._register("register_blocks_cache", cache_desc, addrs, key, blocks=True)

    def _register(self, what: str, desc: CacheDesc, addrs: list[int], key: int | None,
                  blocks: bool = False) -> Cache:
        owner = self._owner
        dd = owner._require()
        if not addrs:
            _invalid("addrs can not be empty.")
        if len(addrs) != desc.num_tensors:
            _invalid("addrs length should be equal to num_tensors.")
        if any(a == 0 for a in addrs):
            _invalid("addr can not be zero.")
        kv_desc = desc._kvflow(Placement.HOST)  # validates the data type
        placement = resolve_placement(addrs, kv_desc.tensor_bytes, desc.placement)
        kv_cache = dd.register_kv_cache(desc._kvflow(placement), list(addrs), key=key)
        owner._caches[kv_cache.cache_id] = _Registered(kv_cache, key)
        owner._next_cache_id = max(owner._next_cache_id, kv_cache.cache_id + 1)
        log.debug("[%s] cache_id=%d placement=%s key=%s", what, kv_cache.cache_id, placement.name, key)
        return Cache(kv_cache.cache_id, desc, list(addrs), self, True, blocks)

    def unregister_cache(self, cache_id: int) -> None:
        """Unregister a cache (call it after unlinking, as in the original). Unknown ids succeed."""
        _check_type("cache_id", cache_id, int, allow_none=False)
        _int64("cache_id", cache_id)
        dd = self._owner._require()
        if cache_id <= 0:
            return
        dd.unregister_kv_cache(cache_id)
        self._owner._caches.pop(cache_id, None)

    def _kv(self, cache: Cache) -> _KvCache:
        """kvflow's Cache for ``cache`` (a stand-in with its id when it is not registered here, so that
        kvflow answers LLM_KV_CACHE_NOT_EXIST)."""
        reg = self._owner._caches.get(cache.cache_id)
        if reg is not None:
            return reg.cache
        return _KvCache(max(cache.cache_id, 0), tuple(cache.tensor_addrs),
                        cache.cache_desc._kvflow(Placement.HOST))

    def _remote_blocks(self, dd: _sync.LlmDataDist, key: BlocksCacheKey) -> CacheIndex:
        """The peer's blocks cache that ``key`` names, resolved over the link."""
        cluster = _uint64("cluster_id", key.cluster_id)
        return CacheIndex(cluster, dd.resolve_cache_key(cluster, _uint64("model_id", key.model_id)))

    # ------------------------------------------------------------------ pulls
    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache, batch_index: int = 0,
                   size: int = -1, *, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy the peer's slot ``cache_key.batch_index`` into local slot ``batch_index`` (``size``
        bytes per tensor; -1: the whole slot), optionally only some layers."""
        if self._owner._settings_or_raise().remote_cache_accessible:
            _check_type("cache_key", cache_key, CacheKeyByIdAndIndex, allow_none=False)
        else:
            _check_type("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex), allow_none=False)
        _check_type("cache", cache, Cache, allow_none=False)
        _uint32("batch_index", batch_index)
        _int64("size", size)
        if cache.is_blocks_cache:
            _invalid("param check failed, cache can not be blocks cache.")
        if not (size == -1 or size > 0):
            _invalid(f"[pull_cache] param check failed, size ({size}) is invalid, should be = -1 or > 0")
        n = _check_per_layer("pull_cache", tensor_num_per_layer, cache.cache_desc.num_tensors)
        if isinstance(cache_key, CacheKey):
            _unsupported("pull_cache(CacheKey)", "name the peer's cache with CacheKeyByIdAndIndex")
        ext = _pull_ext(src_layer_range, dst_layer_range, n, cache.cache_desc.num_tensors)
        dd = self._owner._require()
        index = CacheIndex(cache_key.cluster_id, cache_key.cache_id, cache_key.batch_index)
        dd.pull_kv_cache(index, self._kv(cache), batch_index, size, ext)

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: Cache,
                    src_blocks: list[int] | tuple[int, ...] | None = (), dst_blocks: list[int] | tuple[int, ...] = (),
                    *, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy the peer's ``src_blocks`` (of the blocks cache ``src_cache_key`` names) into local
        ``dst_blocks``, pairwise, optionally only some layers."""
        _check_type("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey),
                    allow_none=False)
        _check_type("dst_cache", dst_cache, Cache, allow_none=False)
        src = _blocks("src_blocks", src_blocks)
        dst = _blocks("dst_blocks", dst_blocks)
        if not dst_cache.is_blocks_cache:
            _invalid("param check failed, dst_cache should be blocks cache.")
        if not dst:
            _invalid("dst_blocks can not be empty.")
        n = _check_per_layer("pull_blocks", tensor_num_per_layer, dst_cache.cache_desc.num_tensors)
        if not isinstance(src_cache_key, BlocksCacheKey):
            if src:
                _invalid("src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.")
            _unsupported("pull_blocks from a contiguous cache into blocks",
                         "kvflow moves whole blocks between caches of equal block size")
        if not src:
            _invalid("src_blocks can not be empty.")
        ext = _pull_ext(src_layer_range, dst_layer_range, n, dst_cache.cache_desc.num_tensors)
        dd = self._owner._require()
        dd.pull_kv_blocks(self._remote_blocks(dd, src_cache_key), self._kv(dst_cache), src, dst, ext)

    # ------------------------------------------------------------------ pushes
    def _check_push(self, what: str) -> None:
        if not self._owner._settings_or_raise().remote_cache_accessible:
            _invalid(f"{what} is only supported while enable_remote_cache_accessible is True")

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy local slot ``src_batch_index`` into the peer's slot ``dst_cache_key.batch_index``
        (every layer of the source by default). Needs ``enable_remote_cache_accessible``."""
        self._check_push("push_cache")
        _check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        _uint32("src_batch_index", src_batch_index)
        if src_cache.is_blocks_cache:
            _invalid("param check failed, cache can not be blocks cache.")
        n = _check_per_layer("push_cache", tensor_num_per_layer, src_cache.cache_desc.num_tensors)
        ext = _push_ext(src_layer_range, dst_layer_range, n, src_cache.cache_desc.num_tensors)
        _int64("size", size)
        if size != -1:
            _invalid(f"[push_cache] param check failed, size ({size}) is invalid, should be = -1.")
        dd = self._owner._require()
        index = CacheIndex(dst_cache_key.cluster_id, dst_cache_key.cache_id, dst_cache_key.batch_index)
        dd.push_kv_cache(self._kv(src_cache), index, src_batch_index, -1, ext)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: list[int] | tuple[int, ...] | None = (), dst_blocks: list[int] | tuple[int, ...] = (),
                    src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = _TENSORS_PER_LAYER) -> None:
        """Copy local ``src_blocks`` into the peer's ``dst_blocks`` of the blocks cache
        ``dst_cache_key`` names (every layer of the source by default). Needs
        ``enable_remote_cache_accessible``."""
        self._check_push("push_blocks")
        _check_type("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        src = _blocks("src_blocks", src_blocks)
        dst = _blocks("dst_blocks", dst_blocks)
        if not src_cache.is_blocks_cache:
            _invalid("param check failed, cache should be blocks cache.")
        if not dst:
            _invalid("dst_blocks can not be empty.")
        n = _check_per_layer("push_blocks", tensor_num_per_layer, src_cache.cache_desc.num_tensors)
        ext = _push_ext(src_layer_range, dst_layer_range, n, src_cache.cache_desc.num_tensors)
        dd = self._owner._require()
        dd.push_kv_blocks(self._kv(src_cache), self._remote_blocks(dd, dst_cache_key), src, dst, ext)

    # ------------------------------------------------------------------ layer-wise push
    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferWithCacheKeyConfig | TransferConfig],
                             src_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer (two tensors per layer) to every config's peer cache, each
        layer once ``layer_synchronizer`` says it is computed; returns a :class:`CacheTask` at once.

        With block indices: those blocks; without: slot ``src_batch_index`` to the destination's slot
        (``batch_index``, 0 for a ``BlocksCacheKey``). A config whose peer cache cannot be found
        (no link, unknown key) fails in the task's results; the others go on."""
        settings = self._owner._settings_or_raise()
        _check_type("src_cache", src_cache, Cache, allow_none=False)
        if src_cache.cache_desc.placement == Placement.HOST:
            _invalid("src cache not support placement HOST")
        src_idx = _blocks("src_block_indices", src_block_indices) if src_block_indices is not None else None
        dst_idx = _blocks("dst_block_indices", dst_block_indices) if dst_block_indices is not None else None
        for name, idx in (("src_block_indices", src_idx), ("dst_block_indices", dst_idx)):
            for v in idx or ():
                _uint64(name, v)
        if dst_block_memory_size is not None:
            _uint64("dst_block_memory_size", dst_block_memory_size)
        if src_idx:
            if not dst_idx:
                _invalid("transfer from blocks to cache is not supported")
            if len(src_idx) != len(dst_idx):
                _invalid(f"num_block_indices mismatches, src_num = {len(src_idx)}, dst_num = {len(dst_idx)}")
        elif dst_idx:
            _unsupported("transfer_cache_async from a contiguous cache into blocks",
                         "kvflow moves whole blocks between caches of equal block size")
        if not isinstance(layer_synchronizer, LayerSynchronizer):
            raise TypeError("layer_synchronizer only support ['LayerSynchronizer'], "
                            f"but got {type(layer_synchronizer)}.")
        want = TransferWithCacheKeyConfig if settings.remote_cache_accessible else TransferConfig
        _check_type("transfer_configs", transfer_configs, (list, tuple), want, allow_none=False)
        if not (dst_idx or dst_block_memory_size in (None, 0)):
            _invalid(f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 while dst is not blocks")
        num_tensors = src_cache.cache_desc.num_tensors
        if num_tensors % _TENSORS_PER_LAYER:
            _invalid(f"cache_desc.num_tensors ({num_tensors}) is not even")
        num_layers = num_tensors // _TENSORS_PER_LAYER
        for cfg in transfer_configs:
            if isinstance(cfg, TransferConfig):
                _unsupported("transfer_cache_async(TransferConfig)", "kvflow reaches a peer's memory only through "
                             "its registered caches: enable remote cache access, use TransferWithCacheKeyConfig")
            rng = cfg.src_layer_range
            if src_idx and cfg.src_batch_index != 0:
                _invalid(f"Invalid TransferConfig, src_batch_index ({cfg.src_batch_index}) != 0 while src is blocks")
            if not 0 <= rng.start < rng.stop <= num_layers:
                _invalid(f"src_layer_range: {rng} out of range, src_layer_num = {num_layers}")
        dd = self._owner._require()
        kv_configs: list[_KvTransferConfig] = []
        slots: list[int | None] = []
        early: dict[int, LLMStatusCode] = {}
        for i, cfg in enumerate(transfer_configs):
            key = cfg.cache_key
            try:
                if isinstance(key, BlocksCacheKey):
                    index = self._remote_blocks(dd, key)
                else:
                    index = CacheIndex(key.cluster_id, key.cache_id, key.batch_index)
            except LLMException as exc:
                log.warning("transfer_cache_async: config %d (%r): %s", i, key, exc)
                early[i] = _code(exc.status_code)
                slots.append(None)
                continue
            slots.append(len(kv_configs))
            kv_configs.append(_KvTransferConfig(index, _inclusive(cfg.src_layer_range),
                                                _inclusive(cfg.dst_layer_range), cfg.src_batch_index))
        task = None
        if kv_configs:
            task = dd.transfer_cache_async(self._kv(src_cache), layer_synchronizer, kv_configs, src_idx or None,
                                           dst_idx or None, _TENSORS_PER_LAYER)
        return CacheTask(task, slots, early)

    # ------------------------------------------------------------------ not supported
    def allocate_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported (register your own memory)."""
        _unsupported("allocate_cache", "deprecated; register memory you allocated with register_cache")

    def allocate_blocks_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("allocate_blocks_cache", "deprecated; register memory you allocated with register_blocks_cache")

    def deallocate_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("deallocate_cache", "deprecated; use unregister_cache")

    def deallocate_blocks_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("deallocate_blocks_cache", "deprecated; use unregister_cache")

    def remove_cache_key(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("remove_cache_key", "deprecated; CacheKey is not supported")

    def copy_cache(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("copy_cache", "deprecated local copy")

    def copy_blocks(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("copy_blocks", "deprecated local copy")

    def swap_blocks(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Deprecated in the original: not supported."""
        _unsupported("swap_blocks", "deprecated host/device swap")

    def remap_registered_memory(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Reserved in the original: not supported."""
        _unsupported("remap_registered_memory", "reserved for device memory faults")


# ---------------------------------------------------------------------- LLMDataDist
_LIVE: weakref.WeakSet[LLMDataDist] = weakref.WeakSet()


class LLMDataDist:
    """One LLM-DataDist instance: ``LLMDataDist(role, cluster_id)``, then ``init(options)``.

    ``cluster_id`` may be any uint64 (0 included) unique among linked peers; ``role`` is a label."""

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        _check_type("role", role, LLMRole, allow_none=False)
        self._role = role
        self._cluster_id = _uint64("cluster_id", cluster_id)
        self._dd: _sync.LlmDataDist | None = None
        self._settings: _Settings | None = None
        self._cache_manager = CacheManager(self)
        self._caches: dict[int, _Registered] = {}
        self._next_cache_id = 1

    def __repr__(self) -> str:
        state = "initialized" if self._dd is not None else "not initialized"
        return f"<llm_datadist.LLMDataDist cluster_id={self._cluster_id} {self._role.name} {state} (kvflow)>"

    # ------------------------------------------------------------------ lifecycle
    def init(self, options: dict[str, str]) -> None:
        """Start: listen if ``llm.listenIpInfo`` (or ``llm.ListenIpInfo``) is given, take the deadline
        from ``llm.SyncKvCacheWaitTime`` (default 1000 ms), pass ``kvflow.*`` options on; other options
        are accepted and ignored (docs/compat.md). A second call does nothing."""
        if self._dd is not None:
            return
        settings = _settings(options)
        dd = _sync.LlmDataDist(self._cluster_id, self._role, options=settings.kvflow_options)
        try:
            dd.initialize()
        except BaseException:
            dd.close()
            raise
        self._dd, self._settings = dd, settings
        self._caches.clear()
        self._next_cache_id = 1
        _LIVE.add(self)

    def finalize(self) -> None:
        """Close every link (telling linked peers) and unregister every cache. Safe to call twice."""
        dd, self._dd = self._dd, None
        self._caches.clear()
        _LIVE.discard(self)
        if dd is not None:
            dd.close()

    def _require(self) -> _sync.LlmDataDist:
        if self._dd is None:
            raise LLMFailed("llm datadist is not initialized")
        return self._dd

    def _settings_or_raise(self) -> _Settings:
        self._require()
        assert self._settings is not None
        return self._settings

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` (after ``init``)."""
        self._require()
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> NoReturn:
        """The V1 ``KvCacheManager``: not supported."""
        _unsupported("kv_cache_manager", "kvflow implements the CacheManager (V2) API")

    @property
    def cluster_id(self) -> int:
        """This instance's cluster id."""
        return self._cluster_id

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(ip, port) this instance listens on (useful with port 0); kvflow extension."""
        return self._dd.listen_address if self._dd is not None else None

    @property
    def kvflow(self) -> _sync.LlmDataDist:
        """The underlying :class:`kvflow.sync.LlmDataDist` (``link_info``, ``stats``); kvflow extension."""
        return self._require()

    # ------------------------------------------------------------------ links
    def _check_clusters(self, clusters: Any, timeout: Any) -> list[LLMClusterInfo]:
        self._require()
        _int32("timeout", timeout)
        if timeout <= 0:
            _invalid("Param timeout should be greater than 0.")
        _check_type("clusters", clusters, (list, tuple), LLMClusterInfo, allow_none=False)
        return list(clusters)

    @staticmethod
    def _overall(rets: list[LLMStatusCode]) -> LLMStatusCode:
        failed = [r for r in rets if r != LLMStatusCode.LLM_SUCCESS]
        return failed[-1] if failed else LLMStatusCode.LLM_SUCCESS

    def link_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster's listen address (at most 16, concurrently, within ``timeout`` ms).
        Returns the overall status (LLM_SUCCESS only if every link succeeded) and one per cluster;
        a failed link is a status, not an exception."""
        clusters = self._check_clusters(clusters, timeout)
        settings = self._settings_or_raise()
        for c in clusters:
            if settings.require_local_ip and not c.local_ip_info_list:
                _invalid("local_ip_info_list is empty. Call append_local_ip_info to add local_ip_info "
                         "when local_comm_res option is unspecified or empty.")
        infos = [c._kvflow() for c in clusters]
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        try:
            rets = [_code(r) for r in self._require().link_llm_clusters(infos, timeout)]
        except LLMException as exc:  # too many clusters, one listed twice: refused before dialing
            log.warning("link_clusters: %s", exc)
            code = _code(exc.status_code)
            return code, [code] * len(infos)
        return self._overall(rets), rets

    def unlink_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000,
                        force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Tear links down. Non-force tells the peer, which drops its side. ``force=True`` always closes
        this side; on a healthy link kvflow tells the peer as well (so that the memory it was granted
        is released), and a peer that does not answer does not make it fail. A cluster without a link
        succeeds, as in the original."""
        clusters = self._check_clusters(clusters, timeout)
        _check_type("force", force, bool)
        infos = [c._kvflow() for c in clusters]
        if not infos:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        dd = self._require()
        graceful = [not force or self._healthy(dd, i.remote_cluster_id) for i in infos]
        try:
            futs = {flag: dd.submit_unlink_llm_clusters([i for i, g in zip(infos, graceful) if g == flag],
                                                        timeout, not flag)
                    for flag in set(graceful)}
            done = {flag: iter(f.result()) for flag, f in futs.items()}
        except LLMException as exc:  # too many clusters, one listed twice
            log.warning("unlink_clusters: %s", exc)
            code = _code(exc.status_code)
            return code, [code] * len(infos)
        rets = []
        for g in graceful:
            r = _code(next(done[g]))
            if r == LLMStatusCode.LLM_NOT_YET_LINK or (force and r == LLMStatusCode.LLM_UNLINK_FAILED):
                r = LLMStatusCode.LLM_SUCCESS  # no link left on this side, which is what was asked
            rets.append(r)
        return self._overall(rets), rets

    @staticmethod
    def _healthy(dd: _sync.LlmDataDist, cluster_id: int) -> bool:
        try:
            return dd.link_info(cluster_id).state == "linked"
        except LLMNotYetLink:
            return False

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> NoReturn:
        """Comm-domain (rank table) linking: not supported; use :meth:`link_clusters`."""
        _unsupported("link", "HCCL comm domains do not exist here; use link_clusters")

    def unlink(self, comm_id: int) -> NoReturn:
        """Comm-domain unlinking: not supported; use :meth:`unlink_clusters`."""
        _unsupported("unlink", "HCCL comm domains do not exist here; use unlink_clusters")

    def query_register_mem_status(self, comm_id: int) -> NoReturn:
        """Comm-domain status: not supported (``link_clusters`` returns once the link is usable)."""
        _unsupported("query_register_mem_status", "HCCL comm domains do not exist here")

    def check_link_status(self, remote_cluster_id: int) -> NoReturn:
        """V1 only: not supported."""
        _unsupported("check_link_status", "it belongs to the V1 API; see kvflow link_info")

    # ------------------------------------------------------------------ roles
    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change the role label and the listening side: with ``llm.listenIpInfo`` in
        ``switch_options`` listen there (a server), without it stop listening (a client). Needs every
        link torn down first (LLM_EXIST_LINK otherwise); registered caches keep their ids."""
        dd = self._require()
        _check_type("role", role, LLMRole, allow_none=False)
        _check_type("switch_options", switch_options, dict)
        links = [peer for peer, e in dd.stats()["links"].items() if e["state"] != "none"]
        if links:
            raise LLMExistLink(f"Can not switch role when link size > 0, please unlink with cluster:{links} first.")
        settings = self._settings_or_raise()
        listen = _listen_of(switch_options or {})
        if listen == settings.listen:
            self._role = role
            return
        kv_options = {k: v for k, v in settings.kvflow_options.items() if k != "llm.ListenIpInfo"}
        if listen is not None:
            kv_options["llm.ListenIpInfo"] = listen
        self._restart(role, kv_options, settings.listen is not None)
        self._settings = _Settings(kv_options, listen, settings.remote_cache_accessible, settings.require_local_ip)
        self._role = role

    def _restart(self, role: LLMRole, kv_options: dict[str, str], was_listening: bool) -> None:
        """Replace the kvflow instance (it cannot change its listen address) by one with
        ``kv_options``, registering every cache again under the same id and key. If the new address
        cannot be bound while the old listener holds it, the old instance is closed first; if the
        new one still fails then, this instance ends up finalized."""
        parse_options(kv_options)  # a malformed option fails here, before anything is closed
        old, regs, next_id = self._require(), dict(self._caches), self._next_cache_id
        new = _sync.LlmDataDist(self._cluster_id, role, options=kv_options)
        try:
            try:
                new.initialize()
            except LLMParamInvalid:  # cannot listen: maybe on the old listener's port
                if not was_listening:
                    raise
                new.close()
                self.finalize()
                new = _sync.LlmDataDist(self._cluster_id, role, options=kv_options)
                new.initialize()
            caches = {}
            for cache_id in sorted(regs):
                reg = regs[cache_id]
                _set_next_cache_id(new, cache_id)
                again = new.register_kv_cache(reg.cache.cache_desc, list(reg.cache.tensor_addrs), key=reg.key)
                if again.cache_id != cache_id:
                    raise LLMFailed(f"switch_role: cache {cache_id} came back as {again.cache_id}")
                caches[cache_id] = _Registered(again, reg.key)
            _set_next_cache_id(new, next_id)
        except BaseException:
            new.close()
            raise
        if self._dd is not None:
            old.close()
        self._dd, self._caches, self._next_cache_id = new, caches, next_id
        _LIVE.add(self)


def _set_next_cache_id(dd: _sync.LlmDataDist, cache_id: int) -> None:
    """Make ``dd``'s next registration get ``cache_id`` (ids only grow, so none is reused)."""
    registry = getattr(getattr(dd, "_dd", None), "_registry", None)
    if registry is None or not hasattr(registry, "_next_id"):
        raise LLMFailed("switch_role: this kvflow version does not let cache ids be carried over")
    registry._next_id = cache_id


def _finalize_all() -> None:
    """At exit, finalize what is still initialized (as the original's atexit hook does)."""
    for dd in list(_LIVE):
        try:
            dd.finalize()
        except Exception as exc:  # the interpreter is going away: report and go on
            log.warning("finalize at exit failed: %s", exc)


atexit.register(_finalize_all)


def __getattr__(name: str) -> Any:
    if name in ("TensorDesc", "Tensor", "KvCacheManager"):
        raise _V1NotSupported(f"{name} is not supported by kvflow.compat.llm_datadist: it belongs to the V1 "
                              "KvCacheManager API (docs/compat.md)")
    raise AttributeError(f"Module 'llm_datadist' has no attribute '{name}'")
