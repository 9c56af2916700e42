"""`trainer.policy.torch_profiler_config`: torch.profiler traces of chosen training steps.

SkyRL's keys, with its meaning: one profiler step is one training step, and
`torch.profiler.schedule(skip_first, wait, warmup, active, repeat)` picks which are traced. A
training step of the RL loop is `optimizer_steps_per_step` calls of `train_mini_batch` on every
policy rank (one per mini-batch and update epoch; the worker counts them in `global_step`, which
checkpoints keep, so a resumed run traces the steps an uninterrupted one would). On a chosen rank
the profiler starts with the first mini-batch it sees and steps after the last mini-batch of each
training step, so a traced step holds everything the worker did since the step before (the
logprob forward passes, then the training passes). Each cycle's trace goes to
``<save_path>/rank_<r>_step_<n>.pt.trace.json`` (n: the cycle's last step; ``.gz`` with
`use_gzip`), or with ``export_type=stacks`` to ``rank_<r>_stacks.txt``, and its path is printed.
CPU activities are traced, and CUDA ones where the worker's device is a GPU.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ProfilerSettings:
    save_path: str
    ranks: tuple[int, ...] = (0,)
    skip_first: int = 10
    wait: int = 0
    warmup: int = 1
    active: int = 1
    repeat: int = 1
    activities: tuple[str, ...] = ("cpu", "cuda")
    record_shapes: bool = True
    profile_memory: bool = False
    with_stack: bool = True
    with_flops: bool = False
    with_modules: bool = False
    use_gzip: bool = False
    export_type: str = "chrome_trace"
    optimizer_steps_per_step: int = 1

    def last_step(self) -> int | None:
        """The last training step the schedule traces (None: it repeats until the run ends)."""
        if self.repeat == 0:
            return None
        return self.skip_first + self.repeat * (self.wait + self.warmup + self.active)


class StepProfiler:
    """The profiler of one policy rank (idle on a rank not in `settings.ranks`)."""

    def __init__(self, settings: ProfilerSettings, rank: int) -> None:
        self.settings, self.rank = settings, rank
        self._profile: Any = None
        self._done = rank not in settings.ranks
        self._step = 0  # the training step in progress (1-based)
        self._cuda = False
        self.written: list[Path] = []

    @contextlib.contextmanager
    def around(self, optimizer_step: int, device: torch.device) -> Iterator[None]:
        """Wrap the mini-batch that will be the worker's optimizer step `optimizer_step` (0-based),
        computed on `device`."""
        k = max(1, self.settings.optimizer_steps_per_step)
        index, within = divmod(optimizer_step, k)
        self._step = index + 1
        last = self.settings.last_step()
        if self._done or (last is not None and self._step > last):
            yield
            return
        if self._profile is None:
            self._start(index, device)
        with torch.profiler.record_function(
            f"skylift/train_step_{self._step}/optimizer_step_{optimizer_step}"
        ):
            yield
        if within == k - 1:  # the training step's last mini-batch: the profiler's step
            self._profile.step()
            if last is not None and self._step >= last:
                self._profile.stop()
                self._profile, self._done = None, True

    def _start(self, steps_before: int, device: torch.device) -> None:
        """Start the schedule as if it had run since step 1 (`steps_before` steps are done)."""
        s = self.settings
        schedule = torch.profiler.schedule(
            skip_first=s.skip_first, wait=s.wait, warmup=s.warmup, active=s.active, repeat=s.repeat
        )
        kinds = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        activities = [kinds[a] for a in s.activities if a == "cpu" or device.type == "cuda"]
        self._profile = torch.profiler.profile(
            activities=activities or [kinds["cpu"]],
            schedule=lambda n: schedule(n + steps_before),
            on_trace_ready=self._write,
            record_shapes=s.record_shapes,
            profile_memory=s.profile_memory,
            with_stack=s.with_stack,
            with_flops=s.with_flops,
            with_modules=s.with_modules,
        )
        self._profile.start()
        self._cuda = bool(activities) and device.type == "cuda"

    def _write(self, profile: Any) -> None:
        folder = Path(self.settings.save_path)
        folder.mkdir(parents=True, exist_ok=True)
        if self.settings.export_type == "stacks":
            path = folder / f"rank_{self.rank}_stacks.txt"
            metric = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
            profile.export_stacks(str(path), metric)
        else:
            path = folder / f"rank_{self.rank}_step_{self._step}.pt.trace.json"
            profile.export_chrome_trace(str(path))
            if self.settings.use_gzip:
                with path.open("rb") as plain, gzip.open(path.with_name(path.name + ".gz"), "wb") as packed:
                    shutil.copyfileobj(plain, packed)
                path.unlink()
                path = path.with_name(path.name + ".gz")
        self.written.append(path)
        first = self._step - self.settings.active + 1
        steps = f"step {self._step}" if first == self._step else f"steps {first}-{self._step}"
        print(f"[skylift] torch.profiler trace of training {steps} (rank {self.rank}): {path}", flush=True)


def profiled(profiler: StepProfiler | None, optimizer_step: int, device: torch.device) -> Any:
    """`profiler.around(...)`, or nothing to do without a profiler."""
    return profiler.around(optimizer_step, device) if profiler is not None else contextlib.nullcontext()
