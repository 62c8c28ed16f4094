"""Helpers for testing kvflow and code built on it (also a pytest plugin: see ``pytest_plugin``)."""
from . import _inspect as inspect  # noqa: F401  (read-only views of internals, for white-box tests)
from ._conformance import check_transport  # noqa: F401  (the suite every transport's tests call)
from ._faulting import FaultingMemory  # noqa: F401  (memory whose page faults stall a copy until resolved)
from ._pair import KvPair, PairConfig, open_pair, pattern  # noqa: F401  (the kvflow_pair fixture's pair)
from ._proxy import FaultProxy  # noqa: F401  (fault-injecting TCP proxy for reliability tests)
