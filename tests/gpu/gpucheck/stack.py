"""The stack the check runs against: skylift's pins (pyproject.toml) beside what the machine has,
and what the check cannot reach without vLLM (and Ray, and the HTTP stack) on the machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]

#: What only a run with skylift's pinned vLLM (CUDA build) on the GPU can show; the lent GPU
#: machine has no vLLM, no Ray and no package index, and 64 MiB of files travel to it.
NOT_CHECKED = (
    "vLLM's CUDA engine: generation, logprobs and sampling against the trainer (train/sample agreement)",
    "weight sync into vLLM workers over NCCL (broadcast, LoRA, delta) and sleep/wake with memory freed",
    "vLLM LoRA adapters on CUDA (Punica kernels) and the Tinker sampler's engine",
    "skylift's vLLM patches on CUDA (cpu_seed_rewind must leave CUDA generators alone)",
    "Ray placement of training workers and engines on GPUs (colocation, several GPUs, several nodes)",
    "FSDP2 beyond world size 1 (one GPU is lent) and tensor parallelism",
    "`skylift serve` / `skylift tinker serve` HTTP stacks (FastAPI, uvicorn, SQLAlchemy) on a GPU host",
)


def pins() -> dict[str, str]:
    """{"torch": ..., "vllm": ...} as pyproject.toml pins them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def pin(requirements: list[str], name: str) -> str:
        for line in requirements:
            match = re.match(rf"{re.escape(name)}\s*==\s*([\w.]+)", line)
            if match:
                return match.group(1)
        raise LookupError(f"pyproject.toml does not pin {name}")

    return {
        "torch": pin(project["dependencies"], "torch"),
        "vllm": pin(project["optional-dependencies"]["gpu"], "vllm"),
    }


def stack_header(torch_version: str) -> dict[str, Any]:
    """The report's view of the stack: pinned, found, and what is not checked here."""
    pinned = pins()
    found = torch_version.split("+", 1)[0]
    return {
        "pinned": pinned,
        "torch_matches_pin": found == pinned["torch"],
        "not_checked": list(NOT_CHECKED),
    }
