"""Experience making: scored trajectories -> one training batch with advantages.

Pure: no engine, no Ray, no worker. The model-dependent quantities come in as functions of the
batch (`policy_logprobs`, `ref_logprobs`, `values`), so a test passes hand-made tensors and a run
passes its worker groups' methods. What comes out is what the policy (and critic) update reads:

- `rollout_logprobs`: the engines' logprobs of the sampled tokens (always);
- `old_logprobs`: the PPO ratio's anchor, from the trainer or the rollout (`old_logprobs_source`);
- `ref_logprobs`: the reference model's, when a KL term is used (untruncated distribution);
- `values`, `returns`: the critic's values and GAE value targets (PPO);
- `advantages`: per response token, 0 on masked positions.

Sequence-level estimators (GRPO, RLOO) get one reward per sequence; the rewards become token-level
(the reward on the last valid token, minus a per-token KL penalty) only where the estimator or a
KL penalty in the reward needs it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from skylift.algorithms import (
    apply_kl_penalty,
    compute_advantages,
    masked_whiten,
    sequence_rewards_to_token_level,
)
from skylift.algorithms.overlong import overlong_rewards
from skylift.config.schema import SkyliftConfig
from skylift.generator import Trajectory, rollout_metrics, turn_reward_tensor
from skylift.generator.metrics import skyrl_generate_metrics
from skylift.rl.dynamic_sampling import zero_variance_uids
from skylift.rl.one_step_off import check_staleness, ppo_old_logprobs_source, staleness_metrics
from skylift.rl.step_wise import check_step_wise, is_step_wise, step_wise_advantages
from skylift.worker.batch import SequenceBatch, build_sequence_batch

BatchFn = Callable[[SequenceBatch], Tensor]
"""A per-token quantity of a batch: `[batch, response_len]` (logprobs or values)."""

OldLogprobsSource = Literal["rollout", "trainer"] | None


@dataclass(frozen=True)
class ExperienceSettings:
    """What experience making reads from the configuration (`from_config`)."""

    advantage_estimator: str = "grpo"
    norm_by_std: bool = True
    gamma: float = 1.0
    lambd: float = 1.0
    batch_normalize: bool = False
    old_logprobs_source: OldLogprobsSource = None
    kl_in_reward: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    zero_variance_filter: bool = False  # SkyRL's: loss-mask the groups whose rewards are all equal
    zero_variance_tol: float = 1e-6
    distillation: bool = False  # the KL-in-reward step gives -(logp - teacher logp) as the whole reward
    max_staleness: int = 0
    pad_token_id: int = 0
    overlong_buffer_len: int = 0  # DAPO's soft overlong punishment (skylift.algorithms.overlong)
    overlong_penalty_factor: float = 1.0
    max_response_len: int = 0

    @classmethod
    def from_config(cls, cfg: SkyliftConfig, pad_token_id: int) -> ExperienceSettings:
        t, alg = cfg.trainer, cfg.trainer.algorithm
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
        return cls(
            advantage_estimator=alg.advantage_estimator,
            norm_by_std=alg.grpo_norm_by_std,
            gamma=alg.gamma,
            lambd=alg.lambd,
            batch_normalize=alg.advantage_batch_normalize,
            old_logprobs_source=old_source,
            kl_in_reward=alg.use_kl_in_reward,
            kl_coef=alg.kl_loss_coef,
            kl_estimator=alg.kl_estimator_type,
            distillation=alg.on_policy_distillation,
            zero_variance_filter=alg.zero_variance_filter,
            zero_variance_tol=alg.zero_variance_filter_tol,
            max_staleness=max_staleness,
            pad_token_id=pad_token_id,
            overlong_buffer_len=alg.overlong_buffer.len,
            overlong_penalty_factor=alg.overlong_buffer.penalty_factor,
            max_response_len=cfg.generator.sampling_params.max_generate_length,
        )


@dataclass
class Experience:
    """A training batch (per-token extras above) with the per-sequence rewards and step metrics."""

    batch: SequenceBatch
    rewards: Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def trajectory_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> SequenceBatch:
    """Padded prompt + response ids of the trajectories, with their rollout logprobs."""
    return build_sequence_batch(
        [tr.prompt_ids for tr in trajectories],
        [tr.response_ids for tr in trajectories],
        [tr.loss_mask for tr in trajectories],
        pad_token_id=pad_token_id,
        per_token={"rollout_logprobs": [tr.rollout_logprobs for tr in trajectories]},
    )


def make_experience(
    trajectories: Sequence[Trajectory],
    settings: ExperienceSettings,
    policy_version: int,
    *,
    policy_logprobs: BatchFn | None = None,
    ref_logprobs: BatchFn | None = None,
    values: BatchFn | None = None,
    full_policy_logprobs: BatchFn | None = None,
) -> Experience:
    """The batch the update of policy version `policy_version` trains on.

    `policy_logprobs` is called when the old logprobs come from the trainer, `ref_logprobs` when
    given (a KL loss or a KL penalty in the reward), `values` when given (the critic of `gae`).
    `full_policy_logprobs` (given when sampling truncates, so old logprobs are the truncated
    distribution's) is called for a KL penalty in the reward: the KL is on untruncated distributions.
    """
    versions = [tr.policy_version for tr in trajectories]
    check_staleness(policy_version, versions, settings.max_staleness)
    metrics = staleness_metrics(policy_version, versions)
    batch = trajectory_batch(trajectories, settings.pad_token_id)
    mask = batch.response_mask
    raw_rewards = [tr.reward for tr in trajectories]
    shaped = overlong_rewards(
        raw_rewards,
        [len(tr.response_ids) for tr in trajectories],
        settings.max_response_len,
        settings.overlong_buffer_len,
        settings.overlong_penalty_factor,
    )
    if settings.overlong_buffer_len > 0:
        metrics["overlong/penalty_mean"] = sum(a - b for a, b in zip(raw_rewards, shaped, strict=True)) / len(
            shaped
        )
    rewards = torch.tensor(shaped, dtype=torch.float32)
    if settings.zero_variance_filter and not any(tr.turn_rewards for tr in trajectories):
        # SkyRL's filter, for response-level rewards: groups without a reward spread count for nothing
        dropped = zero_variance_uids(list(trajectories), settings.zero_variance_tol, shaped)
        keep = torch.tensor([tr.uid not in dropped for tr in trajectories], dtype=mask.dtype)
        mask = mask * keep[:, None]
        batch = dataclasses.replace(batch, response_mask=mask)
        metrics["reward/num_zero_variance_filtered"] = float(len(dropped))

    tick = time.perf_counter()
    if settings.old_logprobs_source == "trainer":
        if policy_logprobs is None:
            raise ValueError("old logprobs from the trainer need policy_logprobs")
        batch = batch.with_extras(old_logprobs=policy_logprobs(batch))
    elif settings.old_logprobs_source == "rollout":
        batch = batch.with_extras(old_logprobs=batch.extras["rollout_logprobs"])
    if ref_logprobs is not None:
        batch = batch.with_extras(ref_logprobs=ref_logprobs(batch))
    if values is not None:
        batch = batch.with_extras(values=values(batch))
    metrics["timing/logprobs_s"] = time.perf_counter() - tick

    # per sequence, unless multi-turn rewards (at each turn's end) or a KL penalty make them per token
    turn_rewards = turn_reward_tensor(trajectories, mask)
    scores: Tensor = rewards if turn_rewards is None else turn_rewards
    if settings.kl_in_reward:
        if "old_logprobs" not in batch.extras or "ref_logprobs" not in batch.extras:
            raise ValueError("a KL penalty in the reward needs old logprobs and ref_logprobs")
        policy_lp = (
            batch.extras["old_logprobs"] if full_policy_logprobs is None else full_policy_logprobs(batch)
        )
        base = sequence_rewards_to_token_level(rewards, mask) if turn_rewards is None else turn_rewards
        coef, estimator = settings.kl_coef, settings.kl_estimator
        if settings.distillation:  # on-policy distillation: the teacher (reference) is the reward
            base, coef, estimator = torch.zeros_like(base), 1.0, "k1"
        scores, kl_metrics = apply_kl_penalty(
            base, policy_lp, batch.extras["ref_logprobs"], mask, coef, estimator
        )
        metrics.update({f"kl_in_reward/{k}": v for k, v in kl_metrics.items()})
    if is_step_wise(trajectories):  # each turn a sample: the rollout's last step's advantage for all
        check_step_wise(settings.advantage_estimator, settings.kl_in_reward)
        advantages, returns = step_wise_advantages(
            settings.advantage_estimator, rewards, mask, trajectories, settings.norm_by_std
        )
    else:
        advantages, returns = compute_advantages(
            settings.advantage_estimator,
            scores,
            mask,
            group_ids=[tr.uid for tr in trajectories],
            values=batch.extras.get("values"),
            gamma=settings.gamma,
            lambd=settings.lambd,
            norm_by_std=settings.norm_by_std,
        )
    if settings.batch_normalize:
        advantages = masked_whiten(advantages, mask, 1e-6)
    batch = batch.with_extras(advantages=advantages)
    if values is not None:
        batch = batch.with_extras(returns=returns)

    metrics.update(_batch_metrics(trajectories, rewards, batch, settings.old_logprobs_source))
    return Experience(batch=batch, rewards=rewards, metrics=metrics)


def _batch_metrics(
    trajectories: Sequence[Trajectory], rewards: Tensor, batch: SequenceBatch, old_source: OldLogprobsSource
) -> dict[str, float]:
    mask = batch.response_mask
    lengths = [tr.num_generated_tokens for tr in trajectories]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": float(max(lengths)),
        "response/truncated_frac": sum(tr.stop_reason != "stop" for tr in trajectories) / len(trajectories),
        "advantages/abs_mean": float(batch.extras["advantages"].abs().sum() / mask.sum().clamp(min=1)),
        **rollout_metrics(trajectories),
        **skyrl_generate_metrics(trajectories),
    }
    if old_source == "trainer":
        # how far the trainer's logprobs of the sampled tokens are from the engine's, before any
        # update of this step (the update's own figure sees already-updated weights after its
        # first mini-batch)
        diff = (batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]).abs() * mask
        metrics["policy/logprob_diff_vs_rollout"] = float(diff.sum() / mask.sum().clamp(min=1))
    return metrics
