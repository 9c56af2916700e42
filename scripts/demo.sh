#!/usr/bin/env bash
# The main job from a fresh clone: set up .venv, then the GRPO demo (SmolLM2-135M learns two-digit
# addition on CPU). Extra arguments are `key=value` overrides for the demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo
exec bash scripts/loopback.sh .venv/bin/skylift demo "$@"
