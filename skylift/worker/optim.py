"""A training worker's optimizer settings and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from skylift.config.schema import OptimizerConfig
from skylift.worker.sharding import full_tensor


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


def clipped_step(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float
) -> Tensor:
    """Clip the gradients of `params` to the global norm `max_norm` and step `optimizer`, unless
    the norm is not finite (the step is then skipped); returns the norm before clipping.

    `torch.nn.utils.clip_grad_norm_` multiplies every gradient by the clip factor, a pass over all
    of them (even by 1 when the norm is under `max_norm`). A fused AdamW takes the factor into its
    own kernel instead (its ``grad_scale``, by which it divides each gradient as it reads it: the
    hook `torch.amp.GradScaler` uses), so the step reads each gradient once.
    """
    if not optimizer.defaults.get("fused"):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if math.isfinite(float(full_tensor(norm))):  # sharded (DTensor) gradients: the global norm
            optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    value = float(norm)
    if not math.isfinite(value):
        return norm
    factor = max_norm / (value + 1e-6)  # clip_grad_norm_'s factor, applied when it is below 1
    if factor < 1.0:
        optimizer.grad_scale = torch.tensor(1.0 / factor, device=norm.device)  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)
    return norm


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


__all__ = ["OptimizerSettings", "clipped_step", "make_lr_scheduler"]
