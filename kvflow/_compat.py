"""Names the core uses for deadlines (kept in one place; Python 3.11+)."""

from __future__ import annotations

from asyncio import timeout

#: What a deadline raises (on 3.11+ ``asyncio.TimeoutError`` is the builtin).
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError,)

__all__ = ["TIMEOUT_ERRORS", "timeout"]
