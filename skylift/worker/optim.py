"""A training worker's optimizer settings and learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OptimizerSettings:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    num_warmup_steps: int = 0
    # learning-rate schedule (transformers' names): constant | constant_with_warmup | linear | cosine;
    # linear and cosine decay to 0 at `total_steps` optimizer steps
    scheduler: str = "constant_with_warmup"
    total_steps: int | None = None


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, o: OptimizerSettings
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of `o` (transformers' implementations of the named schedules)."""
    from transformers import get_scheduler

    warmup = max(0, o.num_warmup_steps)
    if o.scheduler in ("linear", "cosine"):
        if not o.total_steps or o.total_steps < 1:
            raise ValueError(f"scheduler {o.scheduler!r} decays over total_steps, which is not set")
        return get_scheduler(
            o.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=o.total_steps
        )
    if o.scheduler == "constant":
        return get_scheduler("constant", optimizer)
    if o.scheduler == "constant_with_warmup":
        return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
    raise ValueError(
        f"unknown scheduler {o.scheduler!r}; use constant, constant_with_warmup, linear or cosine"
    )


__all__ = ["OptimizerSettings", "make_lr_scheduler"]
