#!/usr/bin/env bash
# The seed's remote inference engine, sized for a CPU machine: SmolLM2-135M-Instruct on 127.0.0.1:8001.
# On GPUs use the seed's values (a larger --model, --tensor-parallel-size 4, --dtype bfloat16,
# --gpu-memory-utilization 0.9, --enable-sleep-mode, --distributed-executor-backend ray).
# Every vLLM server flag works; `skylift serve` is the same program. Start run_remote.sh in
# another shell once the server logs that it is ready.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

.venv/bin/python -m skylift.inference.server \
    --model smollm2-135m-instruct \
    --tensor-parallel-size 1 \
    --host 127.0.0.1 \
    --port 8001 \
    --seed 42 \
    --max-model-len 1024 \
    --enable-prefix-caching \
    --enable-chunked-prefill \
    --dtype float32 \
    --max-num_batched_tokens 8192 \
    --max-num-seqs 256 \
    --trust-remote-code \
    --enforce-eager \
    --worker-extension-cls skylift.inference.vllm_worker.WeightSyncWorkerExtension
