#!/usr/bin/env bash
# Run a command in a loopback-only network namespace when this machine has other interfaces.
# Ray and gloo listen on every interface whatever they are told; inside the namespace only `lo`
# exists. Root uses `unshare -n`, other users `unshare -rn` (unprivileged user namespaces); where
# neither works the command runs as it is, with a warning.
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: scripts/loopback.sh COMMAND [ARGS...]" >&2
  exit 2
fi
# `grep -v ... >/dev/null`, not `grep -qv`: grep -q exits at the first match, ip may then die of
# SIGPIPE, and with pipefail the test would randomly say "only lo" and skip the namespace.
if [[ "${SKYLIFT_IN_NETNS:-0}" == 1 ]] || ! ip -o link show 2>/dev/null | grep -v ': lo:' >/dev/null; then
  exec "$@"
fi
if [[ $(id -u) -eq 0 ]]; then NS=(unshare -n); else NS=(unshare -rn); fi
if ! "${NS[@]}" true 2>/dev/null; then
  echo "[skylift] cannot create a network namespace here; running without one (Ray listens on all interfaces)" >&2
  exec "$@"
fi
cmd=""
for a in "$@"; do cmd+=" $(printf '%q' "$a")"; done
export SKYLIFT_IN_NETNS=1
exec "${NS[@]}" sh -c "ip link set lo up && exec$cmd"
