"""Registration refuses memory it cannot address as its descriptor says: strided, wrong dtype, too small."""

from __future__ import annotations

import array
import ctypes
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, LLMParamInvalid, LLMStatusCode
from kvflow._memory import ELEMENT_NAMES

F16 = CacheDesc(num_tensors=2, data_type=DataType.DT_FLOAT16, shape=[4, 8])  # 64 bytes per tensor
TCP = {"kvflow.Transports": "tcp"}


class DLPackOnly:
    """Exposes another object's memory through ``__dlpack__`` alone (no buffer protocol, no data_ptr)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.inner.__dlpack_device__()


@pytest_asyncio.fixture
async def dd() -> AsyncIterator[LlmDataDist]:
    async with LlmDataDist(cluster_id=1, options=TCP) as d:
        yield d


async def _refused(dd: LlmDataDist, bad: Any, reason: str, desc: CacheDesc = F16) -> None:
    """Registering [good, bad] raises LLMParamInvalid naming addrs[1] and ``reason``."""
    good = np.zeros(desc.tensor_bytes, np.uint8)
    with pytest.raises(LLMParamInvalid, match=r"addrs\[1\]: .*" + reason) as info:
        await dd.register_kv_cache(desc, [good, bad])
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def _torch() -> Any:
    return pytest.importorskip("torch")


# ------------------------------------------------------------------ refused: numpy and buffers

def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


NUMPY_REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "numpy strided": (lambda: np.zeros((4, 16), np.float16)[:, ::2], "not C-contiguous"),
    "numpy transposed": (lambda: np.zeros((8, 4), np.float16).T, "not C-contiguous"),
    "numpy float32 under DT_FLOAT16": (lambda: np.zeros(32, np.float32), "dtype float32 does not match .*DT_FLOAT16"),
    "numpy int16 under DT_FLOAT16": (lambda: np.zeros(32, np.int16), "dtype int16 does not match"),
    "numpy int8 is typed": (lambda: np.zeros(64, np.int8), "dtype int8 does not match"),
    "numpy too small": (lambda: np.zeros(31, np.float16), "holds 62 bytes, a tensor needs 64"),
    "numpy big-endian": (lambda: np.zeros(32, ">f2"), "not in native byte order"),
    "numpy read-only": (lambda: _readonly(np.zeros(32, np.float16)), "read-only"),
    "memoryview format f": (lambda: memoryview(array.array("f", [0.0] * 32)), "dtype float32 does not match"),
    "memoryview format h": (lambda: memoryview(np.zeros(32, np.int16)), "dtype int16 does not match"),
    "memoryview format b": (lambda: memoryview(array.array("b", [0] * 64)), "dtype int8 does not match"),
    "memoryview strided": (lambda: memoryview(np.zeros((4, 32), np.uint8)[:, ::2]), "not C-contiguous"),
    "memoryview too small": (lambda: memoryview(bytearray(63)), "holds 63 bytes, a tensor needs 64"),
    "bytes read-only": (lambda: b"\0" * 64, "read-only"),
    "dlpack strided": (lambda: DLPackOnly(np.zeros((4, 16), np.float16)[:, ::2]), "not C-contiguous"),
    "dlpack float32": (lambda: DLPackOnly(np.zeros(32, np.float32)), "dtype float32 does not match"),
    "dlpack too small": (lambda: DLPackOnly(np.zeros(16, np.float16)), "holds 32 bytes"),
    "not memory": (lambda: "nope", "expected an int address"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(NUMPY_REFUSED))
async def test_refused_numpy_buffer_dlpack(dd: LlmDataDist, case: str) -> None:
    make, reason = NUMPY_REFUSED[case]
    await _refused(dd, make(), reason)


# ------------------------------------------------------------------ refused: torch

def _torch_refused(torch: Any) -> dict[str, tuple[Any, str]]:
    f16 = torch.float16
    return {
        "strided t[..., ::2]": (torch.zeros(4, 16, dtype=f16)[..., ::2], "tensor is not contiguous"),
        "transposed .t()": (torch.zeros(8, 4, dtype=f16).t(), "tensor is not contiguous"),
        "transposed .transpose(1, 2)": (torch.zeros(2, 4, 4, dtype=f16).transpose(1, 2), "tensor is not contiguous"),
        "float32 under DT_FLOAT16": (torch.zeros(32, dtype=torch.float32), "dtype float32 does not match .*DT_FLOAT16"),
        "bfloat16 under DT_FLOAT16": (torch.zeros(32, dtype=torch.bfloat16), "dtype bfloat16 does not match"),
        "int16 under DT_FLOAT16": (torch.zeros(32, dtype=torch.int16), "dtype int16 does not match"),
        "too small": (torch.zeros(31, dtype=f16), "holds 62 bytes, a tensor needs 64"),
        "sparse": (torch.zeros(32, dtype=f16).to_sparse(), "layout torch.sparse_coo"),
        "dlpack strided": (DLPackOnly(torch.zeros(4, 16, dtype=f16)[..., ::2]), "not C-contiguous"),
        "dlpack bfloat16, no buffer": (DLPackOnly(torch.zeros(32, dtype=torch.bfloat16)), "cannot read its DLPack"),
    }


TORCH_CASES = ["strided t[..., ::2]", "transposed .t()", "transposed .transpose(1, 2)", "float32 under DT_FLOAT16",
               "bfloat16 under DT_FLOAT16", "int16 under DT_FLOAT16", "too small", "sparse", "dlpack strided",
               "dlpack bfloat16, no buffer"]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", TORCH_CASES)
async def test_refused_torch(dd: LlmDataDist, case: str) -> None:
    cases = _torch_refused(_torch())
    assert set(cases) == set(TORCH_CASES)
    bad, reason = cases[case]
    await _refused(dd, bad, reason)


@pytest.mark.asyncio
async def test_torch_bfloat16_views_only_as_bf16(dd: LlmDataDist) -> None:
    torch = _torch()
    bf16 = CacheDesc(1, DataType.DT_BF16, [4, 8])
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    cache = await dd.register_kv_cache(bf16, [t])
    assert cache.tensor_addrs == (t.data_ptr(),)
    with pytest.raises(LLMParamInvalid, match=r"addrs\[0\]: dtype bfloat16 does not match data_type DT_FLOAT16"):
        await dd.register_kv_cache(CacheDesc(1, DataType.DT_FLOAT16, [4, 8]), [t])
    with pytest.raises(LLMParamInvalid, match=r"addrs\[0\]: dtype float16 does not match data_type DT_BF16"):
        await dd.register_kv_cache(bf16, [t.view(torch.float16)])


# ------------------------------------------------------------------ allowed

def test_every_data_type_has_an_element_name() -> None:
    assert set(ELEMENT_NAMES) == set(DataType)
    for dt, name in ELEMENT_NAMES.items():
        if name != "bfloat16":  # numpy has none
            assert np.dtype(name).itemsize == dt.itemsize, dt


@pytest.mark.asyncio
@pytest.mark.parametrize("dt", list(DataType), ids=lambda d: d.name)
async def test_matching_dtype_registers(dd: LlmDataDist, dt: DataType) -> None:
    desc = CacheDesc(1, dt, [4, 8])
    name = ELEMENT_NAMES[dt]
    if name != "bfloat16":
        arr = np.zeros((4, 8), np.dtype(name))
        cache = await dd.register_kv_cache(desc, [arr])
        assert cache.tensor_addrs == (arr.ctypes.data,)
        mv = memoryview(arr)
        assert (await dd.register_kv_cache(desc, [mv])).tensor_addrs == (arr.ctypes.data,)
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=getattr(torch, name))
    assert (await dd.register_kv_cache(desc, [t])).tensor_addrs == (t.data_ptr(),)


UNTYPED: dict[str, Callable[[int], Any]] = {
    "numpy uint8": lambda n: np.zeros(n, np.uint8),
    "numpy uint8 2-d": lambda n: np.zeros((4, n // 4), np.uint8),
    "bytearray": lambda n: bytearray(n),
    "memoryview B": lambda n: memoryview(bytearray(n)),
    "memoryview c (ctypes char array)": lambda n: (ctypes.c_char * n)(),
    "dlpack uint8": lambda n: DLPackOnly(np.zeros(n, np.uint8)),
    "larger than needed": lambda n: np.zeros(n + 100, np.uint8),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(UNTYPED))
@pytest.mark.parametrize("dt", [DataType.DT_FLOAT16, DataType.DT_BF16, DataType.DT_INT32, DataType.DT_DOUBLE],
                         ids=lambda d: d.name)
async def test_untyped_bytes_register_under_any_dtype(dd: LlmDataDist, case: str, dt: DataType) -> None:
    desc = CacheDesc(2, dt, [4, 8])
    cache = await dd.register_kv_cache(desc, [UNTYPED[case](desc.tensor_bytes) for _ in range(2)])
    assert cache.cache_id > 0


@pytest.mark.asyncio
async def test_torch_uint8_and_contiguous_views_register(dd: LlmDataDist) -> None:
    torch = _torch()
    base = torch.zeros(6, 8, dtype=torch.float16)
    rows = base[1:5]  # a slice along dim 0 is still contiguous
    u8 = torch.zeros(F16.tensor_bytes, dtype=torch.uint8)
    cache = await dd.register_kv_cache(F16, [rows, u8])
    assert cache.tensor_addrs == (rows.data_ptr(), u8.data_ptr())
    assert rows.data_ptr() == base.data_ptr() + 8 * 2


@pytest.mark.asyncio
async def test_int_addresses_are_vouched_for(dd: LlmDataDist) -> None:
    """An int carries no layout: as in LLM-DataDist, the caller vouches for it (even float32 memory)."""
    arrs = [np.zeros(32, np.float32) for _ in range(2)]
    cache = await dd.register_kv_cache(F16, [int(a.ctypes.data) for a in arrs])
    assert cache.tensor_addrs == tuple(a.ctypes.data for a in arrs)


# ------------------------------------------------------------------ end to end

@pytest.mark.asyncio
async def test_strided_view_refused_before_any_byte_moves() -> None:
    """The original bug: a pull into ``t[..., ::2]`` wrote the view's bytes contiguously from its
    first element, over the elements the view skips. Now the registration fails, so no pull can
    target it and the base tensor stays as it was; a contiguous tensor receives the bytes."""
    torch = _torch()
    desc = CacheDesc(1, DataType.DT_FLOAT16, [4, 8])
    async with LlmDataDist(1, options={**TCP, "llm.ListenIpInfo": "127.0.0.1:0"}) as src, \
            LlmDataDist(2, options=TCP) as dst:
        values = torch.arange(32, dtype=torch.float16).reshape(4, 8) + 1
        rc = await src.register_kv_cache(desc, [values])
        assert src.listen_address is not None
        assert await dst.link_llm_clusters([ClusterInfo(1, [IpInfo(*src.listen_address)])], 5000) == [0]
        base = torch.zeros(4, 16, dtype=torch.float16)
        before = base.clone()
        with pytest.raises(LLMParamInvalid, match=r"addrs\[0\]: tensor is not contiguous"):
            await dst.register_kv_cache(desc, [base[..., ::2]])
        assert torch.equal(base, before)
        good = torch.zeros(4, 8, dtype=torch.float16)
        cache = await dst.register_kv_cache(desc, [good])
        await dst.pull_kv_blocks(CacheIndex(1, rc.cache_id), cache, [0, 1, 2, 3], [0, 1, 2, 3])
        assert torch.equal(good, values)
        assert torch.equal(base, before)
