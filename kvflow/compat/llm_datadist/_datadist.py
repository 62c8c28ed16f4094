"""The :class:`LLMDataDist` of :mod:`kvflow.compat.llm_datadist`: lifecycle, links, roles, and
finalizing what is still initialized at exit."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, NoReturn

from ... import sync as _sync
from ..._options import parse_options
from ..._status import LLMException, LLMExistLink, LLMFailed, LLMNotYetLink, LLMParamInvalid
from ._config import LLMClusterInfo, _listen_of, _Settings, _settings
from ._manager import CacheManager, _Registered
from ._status import LLMRole, LLMStatusCode, _check_type, _code, _int32, _invalid, _uint64, _unsupported

log = logging.getLogger("kvflow.compat.llm_datadist")


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
