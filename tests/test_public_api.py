"""The public surface: names from DESIGN.md, status numbers, exception classes."""

from __future__ import annotations

import kvflow
from kvflow import LLMException, LLMStatusCode, LLMTimeoutError, LLMWaitProcessTimeout
from kvflow._status import error_for


def test_all_names_exist_and_live_in_kvflow() -> None:
    assert len(set(kvflow.__all__)) == len(kvflow.__all__)
    for name in kvflow.__all__:
        obj = getattr(kvflow, name)
        if isinstance(obj, type):
            assert obj.__module__ == "kvflow", name
    public = {n for n in dir(kvflow) if not n.startswith("_") and not isinstance(getattr(kvflow, n), type(kvflow))}
    assert public <= set(kvflow.__all__) | {"annotations"}


def test_design_names_are_exported() -> None:
    for name in ("LlmDataDist", "LlmRole", "DataType", "Placement", "CacheDesc", "Cache", "CacheIndex",
                 "KvCacheExtParam", "ClusterInfo", "IpInfo", "LLMStatusCode", "LLMException"):
        assert hasattr(kvflow, name), name


def test_status_numbers_match_llm_datadist() -> None:
    assert LLMStatusCode.LLM_SUCCESS == 0
    assert LLMStatusCode.LLM_FAILED == 0xFFFFFFFF
    assert LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT == 0x5010B001
    assert LLMStatusCode.LLM_KV_CACHE_NOT_EXIST == 0x5010B002
    assert LLMStatusCode.LLM_PARAM_INVALID == 0x5010B005
    assert LLMStatusCode.LLM_NOT_YET_LINK == 0x5010B007
    assert LLMStatusCode.LLM_ALREADY_LINK == 0x5010B008
    assert LLMStatusCode.LLM_LINK_FAILED == 0x5010B009
    assert LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT == 0x5010B00C
    assert LLMStatusCode.LLM_TIMEOUT == 0x5010B01A


def test_every_code_maps_to_a_typed_error() -> None:
    for code in LLMStatusCode:
        if code == LLMStatusCode.LLM_SUCCESS:
            continue
        exc = error_for(int(code), "x")
        assert isinstance(exc, LLMException) and exc.status_code == code
    assert isinstance(error_for(0x1234), LLMException) and error_for(0x1234).status_code == LLMStatusCode.LLM_FAILED
    assert issubclass(LLMTimeoutError, TimeoutError) and issubclass(LLMWaitProcessTimeout, TimeoutError)


def test_exceptions_pickle_with_their_code() -> None:
    import pickle

    exc = pickle.loads(pickle.dumps(error_for(int(LLMStatusCode.LLM_NOT_YET_LINK), "no link")))
    assert type(exc).__name__ == "LLMNotYetLink" and exc.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert "no link" in str(exc)
