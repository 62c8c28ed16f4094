"""Small shims across the supported Python versions (3.10+)."""

from __future__ import annotations

import asyncio
import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised on 3.10 only
    from async_timeout import timeout

#: What a deadline raises: builtin TimeoutError on 3.11+, asyncio.TimeoutError on 3.10.
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)

__all__ = ["TIMEOUT_ERRORS", "timeout"]
