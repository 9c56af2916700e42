#!/usr/bin/env bash
# Run the whole test suite (lint, unit, integration, tinker; on 2+ cores in two pinned halves:
# scripts/test_halves.sh). Extra arguments go to pytest (one process),
# e.g. `bash scripts/test.sh tests/unit -x`. Sets up .venv first if needed (outside the
# namespace: installing needs the package index), then runs in a loopback-only network namespace
# (scripts/loopback.sh): Ray, gloo and the test servers stay on 127.0.0.1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${SKYLIFT_IN_NETNS:-0}" != 1 ]]; then
  bash scripts/setup.sh  # a no-op when .venv is up to date
  if ip -o link show 2>/dev/null | grep -v ': lo:' >/dev/null; then  # not grep -q: see loopback.sh
    exec bash scripts/loopback.sh bash scripts/test.sh "$@"
  fi
fi
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check skylift tests benchmarks
.venv/bin/ruff format --check skylift tests benchmarks
.venv/bin/python scripts/import_graph.py  # the package graph; fails on a cycle or an upward import
if [[ $# -eq 0 && "${SKYLIFT_TEST_SPLIT:-1}" != 0 && $(nproc) -ge 2 ]]; then
  exec bash scripts/test_halves.sh  # every test, two pytest processes pinned to one core each
fi
set +e
.venv/bin/pytest "$@"  # every test under tests/ (pyproject testpaths) unless told which
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "[test] pytest collected no tests: failing" >&2
fi
exit $rc
