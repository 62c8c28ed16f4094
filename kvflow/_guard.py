"""The guard between kvflow's event loop thread and small copies made on callers' threads.

``kvflow.sync`` moves a small one-sided batch (shm) on the calling thread itself, skipping the two
thread hand-offs of a loop round trip (see ``TransferEngine.run_now``). Such a copy holds
:data:`GUARD` from its last check to its last byte. The loop thread takes :data:`GUARD` whenever it
retires something that copy relies on: a link leaving ``linked`` or starting to close, a peer's cache
forgotten, a local cache starting to unregister. So a copy either ends before the retirement or sees
it and steps back to the loop. The loop holds it only for an assignment; a copy only for a batch
small enough to be moved inline (``kvflow.shm.InlineBytes``)."""

from __future__ import annotations

import threading

GUARD = threading.Lock()
