"""Worker threads for bulk copies, at a scheduling priority that leaves the event loops on time.

A copy thread that competes with the caller's loop thread for a core makes the loop late: on a
two-core machine with two copy threads busy, 1 ms ticks fired 3-5 ms late. Under ``SCHED_IDLE``
(Linux) a copy thread runs only on a core nobody else wants, so a loop thread that wakes takes the
core at once; copies then run as fast as before on an otherwise idle machine. The price: on a
machine whose cores are all busy with other work, copies wait for them (``kvflow.WorkerPriority``
= ``normal`` keeps them at the default priority). See docs/decisions.md."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("kvflow.workers")

PRIORITIES = ("idle", "normal")
DEFAULT_PRIORITY = "idle"


def lower_priority(priority: str) -> None:
    """Set the calling thread's scheduling policy for ``priority`` (a no-op for ``normal``)."""
    if priority != "idle" or not hasattr(os, "SCHED_IDLE"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except OSError as exc:  # a seccomp profile may refuse it: the copy still runs, only less politely
        log.debug("worker thread keeps its priority: %s", exc)


def worker_pool(name: str, threads: int, priority: str = DEFAULT_PRIORITY) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``name-N``, each set to ``priority`` when it starts."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority, initargs=(priority,))
