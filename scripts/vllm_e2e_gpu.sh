#!/usr/bin/env bash
# GPU end-to-end check of KvflowConnector (docs/vllm.md): a prefill and a decode vLLM instance of a
# tiny Llama with dummy weights on one GPU, linked over ucx; their tokens against one instance's.
# Needs the developer install (README.md) on a machine with an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
nvidia-smi -L
exec python3 scripts/vllm_e2e_gpu.py "$@"
