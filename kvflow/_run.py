"""Running a coroutine on uvloop when it is installed."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None) -> T:
    """``asyncio.run(main)`` on uvloop when installed (or when ``use_uvloop`` is True)."""
    if use_uvloop is not False:
        try:
            import uvloop
        except ImportError:
            if use_uvloop:
                raise
        else:
            return uvloop.run(main)
    return asyncio.run(main)
