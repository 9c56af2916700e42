"""Advantages of step-wise trajectories (`generator.step_wise_trajectories`): each turn of a rollout
is its own sample; the rollout's last step stands for the rollout in the estimator (its group is
the prompt's rollouts), and every step of the rollout gets that advantage on its response tokens.
Only sequence-level estimators (one score per rollout: ``grpo``, ``rloo``) apply; per-token
estimators and a KL penalty in the reward would need one sequence per rollout.
Mini-batches hold the steps of as many rollouts as they would hold samples without step-wise
trajectories, so a training step makes as many optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from skylift.algorithms import get_advantage_estimator
from skylift.algorithms.advantages import advantage_estimator_names, is_sequence_level
from skylift.generator import Trajectory


def is_step_wise(trajectories: Sequence[Trajectory]) -> bool:
    return any(tr.trajectory_id is not None for tr in trajectories)


def check_step_wise(estimator: str, kl_in_reward: bool) -> None:
    """Refuse what step-wise advantages cannot be: a per-token estimator or a KL penalty in the reward."""
    if not is_sequence_level(estimator):
        known = [n for n in advantage_estimator_names() if is_sequence_level(n)]
        raise ValueError(
            f"generator.step_wise_trajectories needs a sequence-level advantage estimator ({', '.join(known)}); "
            f"trainer.algorithm.advantage_estimator={estimator} works per token"
        )
    if kl_in_reward:
        raise ValueError(
            "generator.step_wise_trajectories does not run with trainer.algorithm.use_kl_in_reward "
            "(use use_kl_loss)"
        )


def step_wise_advantages(
    estimator: str,
    rewards: Tensor,
    response_mask: Tensor,
    trajectories: Sequence[Trajectory],
    norm_by_std: bool,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns (`[batch, response_len]`, equal) of step-wise samples.

    `rewards`: one per sample (each step carries its rollout's). A sample without a rollout id is
    a rollout of its own. A rollout whose last step is missing from the batch is an error.
    """
    # a rollout is its prompt's uid and its id (dynamic sampling's copies of a group get new uids)
    ids = [f"{tr.uid}|{tr.trajectory_id or f'#{i}'}" for i, tr in enumerate(trajectories)]
    last = {ids[i]: i for i, tr in enumerate(trajectories) if tr.last_step or tr.trajectory_id is None}
    missing = sorted({i for i in ids if i not in last})
    if missing:
        raise ValueError(f"step-wise rollouts without their last step in the batch: {missing[:3]}")
    rows = list(last.values())
    mask = response_mask.to(rewards.dtype)
    # as compute_advantages: a last step without a valid token carries no reward
    valid = (mask[rows] != 0).any(dim=-1)
    scores = torch.where(valid, rewards[rows], torch.zeros_like(rewards[rows]))
    per_rollout, _ = get_advantage_estimator(estimator)(  # type: ignore[call-arg]
        sequence_rewards=scores,
        response_mask=torch.ones(len(rows), 1, dtype=rewards.dtype),
        group_ids=[trajectories[i].uid for i in rows],
        norm_by_std=norm_by_std,
        eps=eps,
    )
    value = dict(zip(last, per_rollout[:, 0].tolist(), strict=True))
    advantages = torch.tensor([value[i] for i in ids], dtype=rewards.dtype)[:, None] * mask
    return advantages, advantages.clone()


def step_wise_rows_per_mini_batch(rows_per_mini_batch: int, trajectories: Sequence[Trajectory]) -> int:
    """Mini-batch rows for step-wise samples: the steps of as many rollouts as `rows_per_mini_batch`
    (so a step makes as many optimizer steps as it would with one sample per rollout)."""
    rollouts = max(1, sum(tr.last_step or tr.trajectory_id is None for tr in trajectories))
    return max(1, math.ceil(len(trajectories) * rows_per_mini_batch / rollouts))
