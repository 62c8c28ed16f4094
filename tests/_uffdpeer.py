"""A kvflow peer (cluster 1, shm) whose one cache lies in ``kvflow.testing.FaultingMemory``: a copy
from a page not yet filled stalls inside ``process_vm_readv`` until the test sends ("resolve", lo,
hi, value). This is how the tests hold a transfer mid-syscall on demand; where userfaultfd is not
allowed, ``serve`` answers {"error": ...}."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any


def serve(conn: Connection, nbytes: int, options: dict[str, str]) -> None:
    from kvflow import CacheDesc, DataType, LlmDataDist, LlmRole
    from kvflow.testing import FaultingMemory

    try:
        mem = FaultingMemory(nbytes)
    except OSError as exc:
        conn.send({"error": str(exc)})
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with LlmDataDist(1, LlmRole.PROMPT, options={"llm.ListenIpInfo": "127.0.0.1:0", **options}) as dd:
            half = nbytes // 2
            desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=[half // 4096, 4096])
            cache = await dd.register_kv_cache(desc, [mem.addr, mem.addr + half])
            conn.send({"port": dd.listen_address[1], "cache_id": cache.cache_id, "half": half})
            while await loop.run_in_executor(None, conn.poll, 120):
                cmd: Any = conn.recv()
                if cmd[0] != "resolve":
                    return
                conn.send(mem.resolve(cmd[3], cmd[1], cmd[2]))

    asyncio.run(main())
