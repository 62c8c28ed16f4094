"""APIs of other KV cache libraries, implemented on kvflow.

- :mod:`kvflow.compat.llm_datadist`: the V2 (CacheManager) Python API of Huawei's ``llm_datadist``
  package, blocking, on :class:`kvflow.sync.LlmDataDist` (docs/compat.md).
"""
