"""GPU end-to-end check of KvflowConnector (issue 16): run on a machine with one NVIDIA GPU.

1. One vLLM instance of a tiny Llama (random weights from a fixed seed, ``load_format="dummy"``,
   no download) generates greedy tokens for a few prompts: the reference.
2. A prefill and a decode instance of the same model, each in its own process on the same GPU,
   linked by KvflowConnector over ucx, generate the same prompts: the decode instance's tokens must
   equal the reference.
3. Time to first token on the decode side (request sent to prefill -> first token out of decode),
   with the pull mode and with the layer-wise push mode.

Usage: python scripts/vllm_e2e_gpu.py [--transport ucx] [--layers 8] [--prompt-len 1024]
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def model_dir(root: Path, layers: int) -> str:
    d = root / "tiny-llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": layers, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    return str(d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_llm(model: str, kv: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=model, load_format="dummy", seed=0, skip_tokenizer_init=True, enforce_eager=True,
               gpu_memory_utilization=0.25, max_model_len=4096,
               kv_transfer_config=KVTransferConfig(**kv) if kv else None)


def sampling(max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": params} if params else None)


def serve(conn: Any, model: str, kv: dict[str, Any]) -> None:
    """An instance in its own process: answers ("generate", prompt, max_tokens, params) requests."""
    llm = make_llm(model, kv)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        _, prompt, max_tokens, params = msg
        out = llm.generate([{"prompt_token_ids": prompt}], sampling(max_tokens, params), use_tqdm=False)[0]
        conn.send((list(out.outputs[0].token_ids), out.kv_transfer_params, time.perf_counter()))


class Instance:
    def __init__(self, model: str, kv: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, model, kv), daemon=True)
        self.proc.start()
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise SystemExit("an instance did not start")
        self.lock = threading.Lock()

    def generate(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Any:
        with self.lock:
            self.conn.send(("generate", prompt, max_tokens, params))
            return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(60)


def kv_config(role: str, transport: str, mode: str, port: int = 0) -> dict[str, Any]:
    return {"kv_connector": "KvflowConnector", "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"port": port, "transport": transport, "mode": mode,
                                          "cluster_id": PREFILL_CLUSTER if port else 0}}


PREFILL_CLUSTER = 1 << 20  # fixed, so that the proxy can name the prefill in a push request


def run_pair(model: str, transport: str, mode: str, prompts: list[list[int]], new_tokens: int
             ) -> tuple[list[list[int]], list[float]]:
    port = free_port()
    prefill = Instance(model, kv_config("kv_producer", transport, mode, port))
    decode = Instance(model, kv_config("kv_consumer", transport, mode))
    tokens, ttft = [], []
    try:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            if mode == "pull":
                _, params, _ = prefill.generate(prompt, 1, {"do_remote_decode": True})
                out, _, _ = decode.generate(prompt, new_tokens, params)
            else:  # the decode instance first: it allocates and tells the prefill where the blocks go
                tid = f"push-{i}"  # names the transfer on both sides (vLLM assigns its own request ids)
                d_params = {"do_remote_prefill": True, "kvflow_mode": "push", "kvflow_transfer_id": tid,
                            "remote_request_id": "", "remote_host": "127.0.0.1", "remote_port": port,
                            "remote_block_ids": [], "remote_cluster_id": PREFILL_CLUSTER}
                with concurrent.futures.ThreadPoolExecutor(1) as ex:
                    waiting = ex.submit(decode.generate, prompt, new_tokens, d_params)
                    prefill.generate(prompt, 1, {"do_remote_decode": True, "kvflow_mode": "push",
                                                 "kvflow_transfer_id": tid})
                    out = waiting.result()[0]
            first = time.perf_counter() - t0  # includes the decode's whole generation: an upper bound
            tokens.append(out)
            ttft.append(first)
    finally:
        prefill.stop()
        decode.stop()
    return tokens, ttft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    model = model_dir(Path(tempfile.mkdtemp()), a.layers)
    prompts = [[(7 * i + j) % 31000 + 3 for j in range(a.prompt_len)] for i in range(a.prompts)]

    ref_llm = make_llm(model, None)
    ref = [list(o.outputs[0].token_ids) for o in
           ref_llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(a.new_tokens, None), use_tqdm=False)]
    del ref_llm
    import gc

    import torch
    gc.collect()
    torch.cuda.empty_cache()

    ok = True
    for mode in ("pull", "push"):
        toks, ttft = run_pair(model, a.transport, mode, prompts, a.new_tokens)
        same = toks == ref
        ok &= same
        print(f"{mode}: tokens equal to one instance: {same}; request -> decode output, median "
              f"{statistics.median(ttft) * 1000:.1f} ms over {len(ttft)} prompts of {a.prompt_len} tokens "
              f"({a.layers} layers, {a.transport})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
