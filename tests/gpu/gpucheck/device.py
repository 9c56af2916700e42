"""Where the check runs: the device, its memory figures, and the context shared by the items."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return platform.processor() or platform.machine()


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mb() -> float:
    """Peak CUDA memory allocated since `reset_peak_memory`; on CPU the process's peak RSS."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def peak_label() -> str:
    return "peak CUDA MiB" if torch.cuda.is_available() else "process peak RSS MiB"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Context:
    """What every item gets: the work directory and the two model directories."""

    work: Path
    tiny_dir: Path
    smollm2_dir: Path
    smollm2_layers: int

    @property
    def models(self) -> dict[str, Path]:
        return {"tiny-qwen2": self.tiny_dir, "smollm2-135m": self.smollm2_dir}

    def vocab_size(self, model: str) -> int:
        import json

        return int(json.loads((self.models[model] / "config.json").read_text())["vocab_size"])
