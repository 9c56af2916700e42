"""The staleness policy of every rollout source: how far behind the trained policy a rollout may
be, when the engines need new weights, and where the PPO ratio's `old_logprobs` come from.

A rollout sampled with the weights of policy version v and trained at version p has staleness
p - v. Synchronous runs train at staleness 0; one-step-off runs (`trainer.async_training`,
`skylift.rl.one_step_off`) at most `trainer.max_staleness_steps`; fully async runs
(`skylift.rl.fully_async`) at most `trainer.fully_async.max_staleness_steps`. The bound is checked
before every update (`check_staleness`); a source syncs weights only when the next batch would
pass it (`needs_weight_sync`).

Off-policy correction (`ppo_old_logprobs_source`): the rollout logprobs come from an older policy.
Without TIS they are the PPO ratio's `old_logprobs`, so the clip acts on the real off-policy gap;
with `trainer.algorithm.use_tis` (or any `trainer.algorithm.off_policy_correction`) the trainer's
logprobs before the update are `old_logprobs` (the clip's anchor) and every token is reweighted by
`min(pi_old / pi_rollout, tis_imp_ratio_cap)` (decoupled PPO with truncated importance sampling),
or per sequence, or masked (skylift.algorithms.off_policy).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from skylift.config.schema import TrainerConfig

OldLogprobsSource = Literal["rollout", "trainer"] | None


def needs_weight_sync(
    policy_version: int, engine_version: int, async_training: bool, max_staleness: int
) -> bool:
    """Whether to broadcast weights after an update, so the next batch launched stays within bounds.

    Synchronous: the next batch is sampled and trained at `policy_version`, so any lag needs a sync.
    Asynchronous: the next batch launched is trained one update later (at `policy_version + 1`);
    its staleness `policy_version + 1 - engine_version` must stay <= `max_staleness`.
    """
    if policy_version == engine_version:
        return False
    if not async_training:
        return True
    return policy_version + 1 - engine_version > max_staleness


def staleness_metrics(policy_version: int, rollout_versions: Sequence[int]) -> dict[str, float]:
    """Staleness of a batch trained at `policy_version` (before its update), for the step's metrics."""
    lags = [policy_version - v for v in rollout_versions]
    return {
        "async/policy_version": float(policy_version),
        "async/rollout_version_min": float(min(rollout_versions)),
        "async/staleness_max": float(max(lags)),
        "async/staleness_mean": statistics.fmean(lags),
    }


def check_staleness(policy_version: int, rollout_versions: Sequence[int], max_staleness: int) -> None:
    """Raise if any rollout is more than `max_staleness` versions behind or from the future."""
    oldest, newest = min(rollout_versions), max(rollout_versions)
    if policy_version - oldest > max_staleness or newest > policy_version:
        raise RuntimeError(
            f"rollouts of policy versions {oldest}..{newest} trained at version {policy_version}: "
            f"staleness must be in [0, {max_staleness}] (trainer.max_staleness_steps)"
        )


def ppo_old_logprobs_source(
    async_training: bool, corrects: bool, multiple_updates: bool
) -> OldLogprobsSource:
    """Where the PPO ratio's `old_logprobs` come from.

    - "rollout": the engine's logprobs of the sampled tokens (async without a correction: the
      ratio and its clip measure the real gap to the policy that sampled);
    - "trainer": a forward pass of the policy before this step's updates (several updates per
      batch, a KL penalty in the reward, or async with a correction (`corrects`: TIS, an
      off-policy mask, rollout_is) of the gap between them and the rollout logprobs);
    - None: exactly on-policy, one update: the current logprobs, detached.
    """
    if async_training:
        return "trainer" if corrects else "rollout"
    return "trainer" if multiple_updates else None


@dataclass(frozen=True)
class StalenessPolicy:
    """A run's staleness bound and old-logprob source (`from_config`: the `trainer` group)."""

    max_staleness: int = 0
    old_logprobs: OldLogprobsSource = None

    @classmethod
    def from_config(cls, t: TrainerConfig) -> StalenessPolicy:
        alg = t.algorithm
        n_mini = t.train_batch_size // t.policy_mini_batch_size
        several_updates = t.update_epochs_per_batch > 1 or n_mini > 1 or alg.use_kl_in_reward
        off_policy = t.async_training or t.fully_async.enabled
        old_source = ppo_old_logprobs_source(off_policy, alg.corrects_off_policy, several_updates)
        if t.fully_async.enabled and not several_updates:
            # one update per batch: its own forward gives the trainer's logprobs before it (the
            # ratio's anchor, detached) and TIS reweights against them; no extra forward pass
            old_source = None
        if t.fully_async.enabled:
            max_staleness = t.fully_async.max_staleness_steps
        else:
            max_staleness = t.max_staleness_steps if t.async_training else 0
        return cls(max_staleness=max_staleness, old_logprobs=old_source)

    def check(self, policy_version: int, rollout_versions: Sequence[int]) -> dict[str, float]:
        """Raise past the bound (`check_staleness`); else the batch's staleness figures."""
        check_staleness(policy_version, rollout_versions, self.max_staleness)
        return staleness_metrics(policy_version, rollout_versions)
