"""The event loop beside ucx copies on a busy host: 3 pulls of 32 MiB over UCX shared memory while
BURNERS other processes spin, and a 2 ms ticker on this loop recording the gaps between its ticks.

    python scripts/ucx_busy_host.py idle 3      # copy helper at SCHED_IDLE (the default)
    python scripts/ucx_busy_host.py normal 3    # kvflow.WorkerPriority=normal
    BASELINE=1 python scripts/ucx_busy_host.py idle 3   # the same load, no transfer

Prints the median, p99 and longest gap; a stall over 300 ms prints where the loop thread was.
"""

import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "transports", "kvflow-ucx", "tests"))
import numpy as np


def _burners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that spin for up to 30 s (ended by the caller)."""
    spin = "import time\nt=time.time()\nwhile time.time()-t<30: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


async def main(prio: str, burners: int) -> None:
    from ucx_testlib import datadist_peer

    from kvflow import CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole
    from kvflow._proc import PeerProcess

    shape = [64, 256 << 10]  # 2 tensors x 16 MiB
    opts = {
        "kvflow.Transports": "ucx",
        "kvflow.ucx.TLS": "sm",
        "kvflow.WorkerPriority": prio,
        "llm.SyncKvCacheWaitTime": "20000",
    }
    peer = PeerProcess(datadist_peer)
    peer.send({"tensors": 2, "shape": shape, "options": {**opts, "llm.ListenIpInfo": "127.0.0.1:0"}})
    info = await peer.recv(60)
    procs = []
    try:
        async with LlmDataDist(2, LlmRole.DECODER, options=opts) as dd:
            assert await dd.link_llm_clusters([ClusterInfo(1, [IpInfo("127.0.0.1", info["port"])])], 5000) == [0]
            desc = CacheDesc(2, DataType.DT_UINT8, shape)
            mine = [np.zeros(desc.tensor_bytes, np.uint8) for _ in range(2)]
            cache = await dd.register_kv_cache(desc, mine)
            ci, blocks = CacheIndex(1, info["cache_id"]), list(range(64))
            await dd.pull_kv_blocks(ci, cache, blocks, blocks)
            procs = _burners(burners)
            await asyncio.sleep(0.3)
            gaps = []
            last = [time.monotonic()]

            async def ticker():
                while True:
                    now = time.monotonic()
                    gaps.append(now - last[0])
                    last[0] = now
                    await asyncio.sleep(0.002)

            tick = asyncio.ensure_future(ticker())
            import threading
            import traceback

            main_id = threading.get_ident()
            done = threading.Event()

            def spy():
                seen = 0
                while not done.is_set():
                    time.sleep(0.05)
                    if time.monotonic() - last[0] > 0.3 and seen < 2:
                        seen += 1
                        st = traceback.format_stack(sys._current_frames()[main_id])
                        print("LOOP STALLED >300ms in:", "".join(st[-3:]), flush=True)

            threading.Thread(target=spy, daemon=True).start()
            t0 = time.monotonic()
            if os.environ.get("BASELINE"):
                await asyncio.sleep(7)
            else:
                for _ in range(3):
                    await dd.pull_kv_blocks(ci, cache, blocks, blocks[::-1])
            took = time.monotonic() - t0
            tick.cancel()
            done.set()
            gaps.sort()
            print(
                f"prio={prio} burners={burners}: 3 pulls of 32 MiB took {took:.2f}s; loop tick gaps "
                f"median {gaps[len(gaps) // 2] * 1000:.1f} ms, p99 {gaps[int(len(gaps) * 0.99)] * 1000:.1f} ms, "
                f"max {gaps[-1] * 1000:.1f} ms (n={len(gaps)}), gaps>100ms: {sum(g > 0.1 for g in gaps)}, "
                f"total in gaps>50ms {sum(g for g in gaps if g > 0.05):.2f}s",
                flush=True,
            )
    finally:
        for p in procs:
            p.kill()
            p.wait()
        peer.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
