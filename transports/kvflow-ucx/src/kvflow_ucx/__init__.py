"""kvflow-ucx: the UCX transport for kvflow (RoCE/InfiniBand verbs, shared memory, TCP).

Found by kvflow through the ``kvflow.transports`` entry point ``ucx``. Importing this package
never loads UCX; :meth:`UcxTransport.unavailable_reason` says whether it can be loaded.
"""

from __future__ import annotations

from ._transport import UcxEndpoint, UcxTransport

__all__ = ["UcxEndpoint", "UcxTransport"]
__version__ = "0.1.0"
