"""The peer description (:class:`LLMClusterInfo`), :class:`LlmConfig` and what
:meth:`LLMDataDist.init` makes of the options, for :mod:`kvflow.compat.llm_datadist`."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._types import ClusterInfo, IpInfo
from ._status import (
    _DEFAULT_SYNC_KV_TIMEOUT_MS,
    _UINT32,
    LLMRole,
    _check_type,
    _int32,
    _invalid,
    _uint16,
    _uint32,
    _uint64,
)

log = logging.getLogger("kvflow.compat.llm_datadist")


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
