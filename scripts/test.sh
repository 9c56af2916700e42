#!/usr/bin/env bash
# Run the whole test suite (lint, unit, integration, tinker). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh tests/unit -x`.
#
# Ray and gloo listen on all network interfaces whatever they are told, so the suite runs in a
# loopback-only network namespace: when this machine has other interfaces, the script re-runs
# itself under `unshare -n` (root) or `unshare -rn` (unprivileged user namespace).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ip -o link show 2>/dev/null | grep -qv ': lo:'; then
  if [[ "${SKYLIFT_IN_NETNS:-0}" == 1 ]]; then
    echo "[test] still see non-loopback interfaces inside the namespace; refusing to run" >&2
    exit 2
  fi
  export SKYLIFT_IN_NETNS=1
  if [[ $(id -u) -eq 0 ]]; then NS=(unshare -n); else NS=(unshare -rn); fi
  args=""
  for a in "$@"; do args+=" $(printf '%q' "$a")"; done
  exec "${NS[@]}" sh -c "ip link set lo up && bash scripts/test.sh$args"
fi

export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo VLLM_CPU_KVCACHE_SPACE=1
.venv/bin/ruff check skylift tests benchmarks
set +e
.venv/bin/pytest tests "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "[test] pytest collected no tests: failing" >&2
fi
exit $rc
