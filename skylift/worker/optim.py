"""A training worker's optimizer settings and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from skylift.config.schema import OptimizerConfig


@dataclass
class OptimizerSettings:
    """A worker's AdamW and learning-rate schedule: a ``trainer.<role>.optimizer_config`` group as
    it is (``lr``, ``adam_betas``, ``weight_decay``, ``max_grad_norm`` (<= 0: no clipping),
    ``num_warmup_steps``, ``scheduler``), and what is not a config key."""

    config: OptimizerConfig = field(default_factory=OptimizerConfig)
    total_steps: int | None = None
    """Optimizer steps of the run: the ``linear`` and ``cosine`` schedules decay to 0 there."""
    eps: float = 1e-8
    """AdamW's eps (the Tinker API sends it with each step)."""

    def adamw(self, params: list[torch.nn.Parameter], **kernel: bool) -> torch.optim.AdamW:
        """AdamW over `params` with these hyper-parameters (`kernel`: fused / foreach)."""
        c = self.config
        betas = (float(c.adam_betas[0]), float(c.adam_betas[1]))
        return torch.optim.AdamW(
            params, lr=c.lr, betas=betas, eps=self.eps, weight_decay=c.weight_decay, **kernel
        )

    def clip_norm(self, override: float | None = None) -> float:
        """The global gradient norm a step clips to: `override` (a caller's norm for this step)
        or the config's ``max_grad_norm``; a norm <= 0 means no clipping (inf)."""
        norm = self.config.max_grad_norm if override is None else override
        return norm if norm > 0 else math.inf


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, o: OptimizerSettings
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of `o` (transformers' implementations of the named schedules)."""
    from transformers import get_scheduler

    c: OptimizerConfig = o.config
    scheduler, warmup = c.scheduler, max(0, c.num_warmup_steps)
    if scheduler in ("linear", "cosine"):
        if not o.total_steps or o.total_steps < 1:
            raise ValueError(f"scheduler {scheduler!r} decays over total_steps, which is not set")
        return get_scheduler(scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=o.total_steps)
    if scheduler == "constant":
        return get_scheduler("constant", optimizer)
    if scheduler == "constant_with_warmup":
        return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
    raise ValueError(f"unknown scheduler {scheduler!r}; use constant, constant_with_warmup, linear or cosine")


__all__ = ["OptimizerSettings", "make_lr_scheduler"]
