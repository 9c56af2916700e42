"""`trainer.policy.torch_profiler_config`: torch.profiler traces of chosen training steps.

A training step of the RL loop is `optimizer_steps_per_step` calls of `train_mini_batch` on every
policy rank (one per mini-batch and update epoch; the worker counts them in `global_step`, which
checkpoints keep). On a chosen rank the profiler starts before the first mini-batch of a chosen
step and stops after its last, then writes a Chrome trace (chrome://tracing, Perfetto) to
``<save_path>/rank_<r>_step_<n>.json`` and prints its path. CPU activities are traced, and CUDA
ones where the worker's device is a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ProfilerSettings:
    save_path: str
    steps: tuple[int, ...]  # training steps, counted from 1
    ranks: tuple[int, ...]
    optimizer_steps_per_step: int = 1


class StepProfiler:
    """Traces the training passes of `settings.steps` on this rank, if it is one of `settings.ranks`."""

    def __init__(self, settings: ProfilerSettings, rank: int) -> None:
        self.settings, self.rank = settings, rank
        self._profile: Any = None
        self.written: list[Path] = []

    def _place(self, optimizer_step: int) -> tuple[int, bool, bool]:
        """(training step, first mini-batch of it, last mini-batch of it) of an optimizer step."""
        k = max(1, self.settings.optimizer_steps_per_step)
        step, index = divmod(optimizer_step, k)
        return step + 1, index == 0, index == k - 1

    @contextlib.contextmanager
    def around(self, optimizer_step: int, device: torch.device) -> Iterator[None]:
        """Wrap the mini-batch that will be the worker's optimizer step `optimizer_step` (0-based),
        computed on `device`."""
        step, first, last = self._place(optimizer_step)
        if self.rank not in self.settings.ranks or step not in self.settings.steps:
            yield
            return
        if first or self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profile.__enter__()
        with torch.profiler.record_function(f"skylift/train_step_{step}/optimizer_step_{optimizer_step}"):
            yield
        if last:
            self._finish(step)

    def _finish(self, step: int) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        path = Path(self.settings.save_path) / f"rank_{self.rank}_step_{step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(path))
        self.written.append(path)
        print(
            f"[skylift] torch.profiler trace of training step {step} (rank {self.rank}): {path}", flush=True
        )


def profiled(profiler: StepProfiler | None, optimizer_step: int, device: torch.device) -> Any:
    """`profiler.around(...)`, or nothing to do without a profiler."""
    return profiler.around(optimizer_step, device) if profiler is not None else contextlib.nullcontext()
