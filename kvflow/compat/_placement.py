"""Where the memory behind an int address lives: the declared ``Placement`` is only a hint.

Code written for NPUs registers every cache with ``Placement.DEVICE``; run on a CPU machine, the
same code hands in host addresses. kvflow needs the truth (a host transport reads host memory with
the CPU; device memory needs a transport that can reach it), so it asks the process:

1. If CUDA is already loaded in this process, it says device or host (pinned or managed memory):
   ``cudaPointerGetAttributes`` of the runtime, else ``cuPointerGetAttribute`` of the driver.
   kvflow never loads CUDA itself: a process without it holds no CUDA memory.
2. Otherwise (or when CUDA does not know the pointer), a range that this process has mapped
   readable and writable (``/proc/self/maps``), other than through a device file, is host memory.
3. Anything else keeps its declared placement when that is ``DEVICE`` (NPU memory, for one: no
   runtime is asked for it); a range declared ``HOST`` that is not mapped here is refused, since
   reading it would crash the process.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence

from .._status import LLMParamInvalid
from .._types import Placement

_CUDA_HOST, _CUDA_DEVICE, _CUDA_MANAGED = 1, 2, 3  # cudaMemoryType (0: unregistered)
_ATTR_BYTES = 256  # cudaPointerAttributes is 24 bytes in CUDA 11/12; room for later versions
_HOST_DEVICE_FILES = ("/dev/shm/", "/dev/zero")

_CU_MEMORY_TYPE, _CU_IS_MANAGED = 2, 8  # CUpointer_attribute
_LIBS: dict[str, ctypes.CDLL] = {}


def _maps() -> list[tuple[int, int, bool, str]]:
    """This process's mappings: (start, end, readable and writable, path), in address order."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 5:
                    continue
                lo, _, hi = parts[0].partition("-")
                path = parts[5].strip() if len(parts) > 5 else ""
                out.append((int(lo, 16), int(hi, 16), parts[1][:2] == "rw", path))
    except OSError:  # no procfs: nothing is known to be host memory
        return []
    return out


def _loaded(maps: list[tuple[int, int, bool, str]], name: str) -> ctypes.CDLL | None:
    """The library whose file name starts with ``name`` if this process already loaded it, else None."""
    path = next((p for *_, p in maps if p.rpartition("/")[2].startswith(name)), None)
    if path is None:
        return None
    lib = _LIBS.get(path)
    if lib is None:
        try:
            lib = _LIBS[path] = ctypes.CDLL(path)
        except OSError:
            return None
    return lib


def _cuda_placement(maps: list[tuple[int, int, bool, str]], addr: int) -> Placement | None:
    """DEVICE for CUDA device memory, HOST for CUDA pinned or managed memory, None when no CUDA is
    loaded, CUDA does not know the pointer, or it cannot answer. The runtime is asked if loaded,
    else the driver (which every CUDA process loads)."""
    rt = _loaded(maps, "libcudart.so")
    if rt is not None and hasattr(rt, "cudaPointerGetAttributes"):
        attrs = ctypes.create_string_buffer(_ATTR_BYTES)
        if rt.cudaPointerGetAttributes(ctypes.c_void_p(addr), attrs) != 0:
            rt.cudaGetLastError()  # reset the error an unknown pointer leaves behind (CUDA < 11)
            return None
        kind = ctypes.c_int.from_buffer(attrs).value  # cudaPointerAttributes.type
        if kind == _CUDA_DEVICE:
            return Placement.DEVICE
        return Placement.HOST if kind in (_CUDA_HOST, _CUDA_MANAGED) else None
    drv = _loaded(maps, "libcuda.so")
    if drv is None or not hasattr(drv, "cuPointerGetAttribute"):
        return None
    value = ctypes.c_uint(0)
    get = drv.cuPointerGetAttribute
    if get(ctypes.byref(value), _CU_IS_MANAGED, ctypes.c_uint64(addr)) == 0 and value.value:
        return Placement.HOST
    if get(ctypes.byref(value), _CU_MEMORY_TYPE, ctypes.c_uint64(addr)) != 0:
        return None  # not CUDA memory (CUDA_ERROR_INVALID_VALUE), or the driver is not initialized
    if value.value == _CUDA_DEVICE:  # CU_MEMORYTYPE_DEVICE has the runtime's number
        return Placement.DEVICE
    return Placement.HOST if value.value == _CUDA_HOST else None


def _host_mapped(maps: list[tuple[int, int, bool, str]], starts: list[int], addr: int, nbytes: int) -> bool:
    """Whether [addr, addr + nbytes) lies in read-write mappings that are not device files."""
    end = addr + max(nbytes, 1)
    i = bisect.bisect_right(starts, addr) - 1
    pos = addr
    while 0 <= i < len(maps) and pos < end:
        lo, hi, rw, path = maps[i]
        device_file = path.startswith("/dev/") and not path.startswith(_HOST_DEVICE_FILES)
        if not (lo <= pos < hi) or not rw or device_file:
            return False
        pos = hi
        i += 1
    return pos >= end


def resolve_placement(addrs: Sequence[int], nbytes: int, declared: Placement) -> Placement:
    """The placement of the ``nbytes`` at each of ``addrs`` (see the module docstring);
    LLMParamInvalid if they mix host and device memory, or if host memory is declared where
    nothing is mapped."""
    maps = _maps()
    starts = [m[0] for m in maps]
    found: list[Placement] = []
    for i, addr in enumerate(addrs):
        kind = _cuda_placement(maps, addr)
        if kind is not None:
            found.append(kind)
        elif _host_mapped(maps, starts, addr, nbytes):
            found.append(Placement.HOST)
        elif declared == Placement.DEVICE:
            found.append(Placement.DEVICE)
        else:
            raise LLMParamInvalid(f"addrs[{i}]: {addr:#x}+{nbytes} is declared host memory but is not mapped "
                                  "read-write in this process")
    kinds = set(found)
    if len(kinds) > 1:
        host = [i for i, p in enumerate(found) if p == Placement.HOST]
        raise LLMParamInvalid(f"addrs mix host memory (entries {host}) and device memory in one cache")
    return found[0] if found else declared
