"""A kvflow peer (cluster 1, shm) whose one cache lies in userfaultfd-registered memory: a copy from a
page not yet filled stalls inside ``process_vm_readv`` until the test sends ("resolve", lo, hi,
value). This is how the tests hold a transfer mid-syscall on demand. userfaultfd needs root,
CAP_SYS_PTRACE or ``vm.unprivileged_userfaultfd=1``; elsewhere ``serve`` answers {"error": ...}."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import struct
from multiprocessing.connection import Connection
from typing import Any

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine, -1)
_UFFDIO_API, _UFFDIO_REGISTER, _UFFDIO_COPY = 0xC018AA3F, 0xC020AA00, 0xC028AA03


def serve(conn: Connection, nbytes: int, options: dict[str, str]) -> None:
    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    fd = libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK) if _SYS_USERFAULTFD > 0 else -1
    if fd < 0:
        conn.send({"error": f"userfaultfd: {os.strerror(ctypes.get_errno())}"})
        return
    api = ctypes.create_string_buffer(struct.pack("QQQ", 0xAA, 0, 0), 24)
    region = mmap.mmap(-1, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    reg = ctypes.create_string_buffer(struct.pack("QQQQ", addr, nbytes, 1, 0), 32)  # mode: missing pages
    if libc.ioctl(fd, _UFFDIO_API, api) != 0 or libc.ioctl(fd, _UFFDIO_REGISTER, reg) != 0:
        conn.send({"error": f"userfaultfd ioctl: {os.strerror(ctypes.get_errno())}"})
        return

    def resolve(lo: int, hi: int, value: int) -> int:
        n = hi - lo
        src = ctypes.create_string_buffer(bytes([value]) * n, n)
        copy = ctypes.create_string_buffer(struct.pack("QQQQq", addr + lo, ctypes.addressof(src), n, 0, 0), 40)
        return int(libc.ioctl(fd, _UFFDIO_COPY, copy))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with LlmDataDist(1, LlmRole.PROMPT, options={"llm.ListenIpInfo": "127.0.0.1:0", **options}) as dd:
            half = nbytes // 2
            desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[half // 4096, 4096])
            cache = await dd.register_kv_cache(desc, [addr, addr + half])
            conn.send({"port": dd.listen_address[1], "cache_id": cache.cache_id, "half": half})
            while await loop.run_in_executor(None, conn.poll, 120):
                cmd: Any = conn.recv()
                if cmd[0] != "resolve":
                    return
                conn.send(resolve(cmd[1], cmd[2], cmd[3]))

    asyncio.run(main())
