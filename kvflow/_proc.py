"""Peer processes for the CLI, examples and tests: a child runs an async function, talks over a Pipe."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Coroutine

AsyncMain = Callable[[Connection], Coroutine[Any, Any, None]]


def _child(main: AsyncMain, conn: Connection) -> None:
    from ._run import run

    run(main(conn))


class PeerProcess:
    """A child process running ``main(conn)`` on its own event loop (uvloop when installed)."""

    def __init__(self, main: AsyncMain) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(main, child_conn), daemon=True)
        self.proc.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    async def recv(self, timeout: float = 30.0) -> Any:
        """The child's next message; TimeoutError if none within ``timeout``; EOFError if it died."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.conn.poll():
            if not self.proc.is_alive() and not self.conn.poll():
                raise EOFError(f"peer process {self.pid} exited with {self.proc.exitcode}")
            if loop.time() > deadline:
                raise TimeoutError(f"peer process {self.pid} sent nothing within {timeout} s")
            await asyncio.sleep(0.002)
        return self.conn.recv()

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the child to stop, wait, then kill it (by its PID) if it is still there."""
        return stop_child(self.proc, self.conn, "stop", timeout)


def stop_child(proc: BaseProcess, conn: Connection, message: object = "stop", timeout: float = 10.0) -> int | None:
    """Send ``message`` to a child process over ``conn``, wait up to ``timeout`` s for it to exit,
    then kill it (SIGKILL, by its PID) if it is still there; close ``conn``. Its exit code."""
    if proc.is_alive():
        try:
            conn.send(message)
        except (OSError, BrokenPipeError):
            pass
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)
    conn.close()
    return proc.exitcode


async def recv_from_parent(conn: Connection) -> Any:
    """In a child: the parent's next message, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(conn.fileno(), ready.set)
    try:
        while not conn.poll():
            ready.clear()
            await ready.wait()
    finally:
        loop.remove_reader(conn.fileno())
        os.set_blocking(conn.fileno(), True)  # the loop may have made it non-blocking; Connection needs blocking
    try:
        return conn.recv()
    except EOFError:
        return "stop"
