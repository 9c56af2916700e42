"""A SkyRL user's custom advantage estimator and policy loss, as SkyRL's examples write them
(``examples/train/algorithms/custom_advantage_estimator`` and ``custom_policy_loss``: the
``simple_baseline`` estimator and the ``reinforce`` loss, with SkyRL's signatures and registry calls);
only the import line names skylift's registries instead of SkyRL's ``ppo_utils``.

Runs name it as ``trainer.algorithm.import_modules=[tests.skyrl_custom_algorithms]``. It records
where its functions ran, so tests can see the estimator ran on the driver and the loss in the
training workers.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from skylift.compat.skyrl.registries import AdvantageEstimatorRegistry, register_policy_loss

ESTIMATOR_CALLS: list[dict[str, object]] = []


def compute_simple_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's reward minus the batch's mean reward, on every response token."""
    ESTIMATOR_CALLS.append({"pid": os.getpid(), "index": list(index), "kwargs": sorted(kwargs)})
    with torch.no_grad():
        response_rewards = (token_level_rewards * response_mask).sum(dim=-1, keepdim=True)
        advantages = (response_rewards - response_rewards.mean()) * response_mask
        return advantages, advantages.clone()


AdvantageEstimatorRegistry.register("simple_baseline", compute_simple_baseline_advantage)


@register_policy_loss("reinforce")
def compute_reinforce_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: object,
    loss_mask: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: minimise ``-log p * A`` (a mean over the micro-batch, as SkyRL's example)."""
    loss = (-log_probs * advantages).mean()
    return loss, {"clip_ratio": 0.0, "reinforce_pid": float(os.getpid())}
