"""Finding transports (and their raw-baseline benches) by name: the built-in tcp, and plugins
registered under the entry-point groups ``kvflow.transports`` and ``kvflow.benches``."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

from ._status import LLMFeatureNotEnabled
from .transport import Transport

__all__ = ["available_transports", "load_bench", "load_transport"]


def _builtin() -> dict[str, type[Transport]]:
    from ._tcp import TcpTransport

    return {"tcp": TcpTransport}


def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def load_transport(name: str) -> type[Transport]:
    """The transport class called ``name``; LLMFeatureNotEnabled (with the reason) if unusable."""
    builtin = _builtin()
    if name in builtin:
        cls = builtin[name]
    else:
        plugins = _entry_points("kvflow.transports")
        ep = plugins.get(name)
        if ep is None:
            known = ", ".join(sorted(set(builtin) | set(plugins)))
            raise LLMFeatureNotEnabled(f"no transport called {name!r} is installed (installed: {known})")
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not break kvflow
            raise LLMFeatureNotEnabled(f"{name}: cannot load {ep.value}: {exc}") from exc
    reason = cls.unavailable_reason()
    if reason:
        raise LLMFeatureNotEnabled(f"{name}: {reason}")
    return cls


def available_transports() -> dict[str, str]:
    """Every installed transport, with ``"ok"`` or the one-line reason it cannot run here."""
    out: dict[str, str] = {}
    for name in sorted(set(_builtin()) | set(_entry_points("kvflow.transports"))):
        try:
            load_transport(name)
        except LLMFeatureNotEnabled as exc:
            out[name] = str(exc.args[0]).removeprefix(f"{name}: ")
        else:
            out[name] = "ok"
    return out


def load_bench(name: str) -> ModuleType | Any:
    """The raw-baseline bench module a plugin registered under ``kvflow.benches`` (``BASELINE_NAME``,
    ``baseline(pid, buf, repeat, remote_addr=)``); LLMFeatureNotEnabled if it registered none."""
    ep = _entry_points("kvflow.benches").get(name)
    if ep is None:
        raise LLMFeatureNotEnabled(f"transport {name!r} registers no bench under the 'kvflow.benches' entry points")
    return ep.load()
