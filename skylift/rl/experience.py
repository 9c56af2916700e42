"""Experience making: scored trajectories -> one training batch with advantages.

Pure: no engine, no Ray, no worker. The model-dependent quantities come in as functions of the
batch (`policy_logprobs`, `ref_logprobs`, `values`), so a test passes hand-made tensors and a run
passes its worker groups' methods. What comes out is what the policy (and critic) update reads:

- `rollout_logprobs`: the engines' logprobs of the sampled tokens (always);
- `old_logprobs`: the PPO ratio's anchor, from the trainer or the rollout (`skylift.rl.staleness`);
- `ref_logprobs`: the reference model's, when a KL term is used (untruncated distribution);
- `values`, `returns`: the critic's values and GAE value targets (PPO);
- `advantages`: per response token, 0 on masked positions.

`make_experience` runs named stages in order over a `Draft` (`ExperienceStages.in_order`), each
built from its own config group: the staleness bound, reward shaping, the model quantities (old
logprobs by the staleness policy), the KL penalty in the reward (or on-policy distillation), the
advantages. Sequence-level estimators (GRPO, RLOO) get one reward per sequence; the rewards become
token-level (the reward on the last valid token, minus a per-token KL penalty) only where the
estimator or a KL penalty in the reward needs it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skylift.algorithms import (
    apply_kl_penalty,
    compute_advantages,
    masked_whiten,
    sequence_rewards_to_token_level,
)
from skylift.algorithms.overlong import overlong_rewards
from skylift.config.algorithm import AlgorithmConfig
from skylift.config.schema import SkyliftConfig
from skylift.generator import Trajectory, rollout_metrics, turn_reward_tensor
from skylift.generator.metrics import MetricsRequest, plugin_metrics
from skylift.rl.dynamic_sampling import zero_variance_uids
from skylift.rl.staleness import StalenessPolicy
from skylift.rl.step_wise import check_step_wise, is_step_wise, step_wise_advantages
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.routing_replay import routing_row
from skylift.worker.vision_inputs import row_inputs

BatchFn = Callable[[SequenceBatch], Tensor]
"""A per-token quantity of a batch: `[batch, response_len]` (logprobs or values)."""


@dataclass(frozen=True)
class Models:
    """The model-dependent quantities as functions of the batch (None: not available)."""

    policy_logprobs: BatchFn | None = None
    ref_logprobs: BatchFn | None = None
    values: BatchFn | None = None
    full_policy_logprobs: BatchFn | None = None  # untruncated, when sampling truncates


@dataclass
class Draft:
    """The experience being made: what each stage reads and adds to."""

    trajectories: Sequence[Trajectory]
    policy_version: int
    batch: SequenceBatch
    rewards: Tensor  # per sequence, as shaped so far
    models: Models
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    scores: Tensor | None = None  # per-token rewards with the KL penalty, when it is in the reward

    def base_scores(self) -> Tensor:
        """The rewards as the estimator reads them without a KL penalty: per sequence, unless
        multi-turn rewards (at each turn's end) make them per token."""
        turn_rewards = turn_reward_tensor(self.trajectories, self.batch.response_mask)
        return self.rewards if turn_rewards is None else turn_rewards


Stage = Callable[[Draft], None]


@dataclass(frozen=True)
class Staleness:
    """The staleness bound (raises past it) and the batch's `async/*` figures."""

    policy: StalenessPolicy

    def __call__(self, d: Draft) -> None:
        d.metrics.update(self.policy.check(d.policy_version, [tr.policy_version for tr in d.trajectories]))


@dataclass(frozen=True)
class RewardShaping:
    """DAPO's soft overlong punishment (`trainer.algorithm.overlong_buffer`), then the
    zero-variance filter (`trainer.algorithm.zero_variance_filter`): groups without a reward spread
    count for nothing."""

    alg: AlgorithmConfig
    max_response_len: int = 0  # generator.sampling_params.max_generate_length

    def __call__(self, d: Draft) -> None:
        raw, buffer = [tr.reward for tr in d.trajectories], self.alg.overlong_buffer
        lengths = [len(tr.response_ids) for tr in d.trajectories]
        shaped = overlong_rewards(raw, lengths, self.max_response_len, buffer.len, buffer.penalty_factor)
        if buffer.len > 0:
            d.metrics["overlong/penalty_mean"] = sum(a - b for a, b in zip(raw, shaped, strict=True)) / len(
                shaped
            )
        d.rewards = torch.tensor(shaped, dtype=torch.float32)
        if self.alg.zero_variance_filter and not any(tr.turn_rewards for tr in d.trajectories):
            # response-level rewards only
            dropped = zero_variance_uids(list(d.trajectories), self.alg.zero_variance_filter_tol, shaped)
            mask = d.batch.response_mask
            keep = torch.tensor([tr.uid not in dropped for tr in d.trajectories], dtype=mask.dtype)
            d.batch = dataclasses.replace(d.batch, response_mask=mask * keep[:, None])
            d.metrics["reward/num_zero_variance_filtered"] = float(len(dropped))


@dataclass(frozen=True)
class ModelQuantities:
    """The PPO anchor (`old_logprobs`, from where the staleness policy says), the reference's
    logprobs and the critic's values, whichever the run has."""

    policy: StalenessPolicy

    def __call__(self, d: Draft) -> None:
        tick, m = time.perf_counter(), d.models
        if self.policy.old_logprobs == "trainer":
            if m.policy_logprobs is None:
                raise ValueError("old logprobs from the trainer need policy_logprobs")
            d.batch = d.batch.with_extras(old_logprobs=m.policy_logprobs(d.batch))
        elif self.policy.old_logprobs == "rollout":
            d.batch = d.batch.with_extras(old_logprobs=d.batch.extras["rollout_logprobs"])
        if m.ref_logprobs is not None:
            d.batch = d.batch.with_extras(ref_logprobs=m.ref_logprobs(d.batch))
        if m.values is not None:
            d.batch = d.batch.with_extras(values=m.values(d.batch))
        d.metrics["timing/logprobs_s"] = time.perf_counter() - tick


@dataclass(frozen=True)
class KLInReward:
    """The KL penalty in the reward (`use_kl_in_reward`, `kl_loss_coef`, `kl_estimator_type`), or
    on-policy distillation (`on_policy_distillation`): the teacher's log-ratio is the whole reward."""

    alg: AlgorithmConfig
    coef: float | None = None  # this step's coefficient (the KL controller's); None: kl_loss_coef

    @property
    def enabled(self) -> bool:
        return self.alg.use_kl_in_reward

    @property
    def distillation(self) -> bool:
        return self.alg.on_policy_distillation

    def __call__(self, d: Draft) -> None:
        if not self.enabled:
            return
        extras, mask = d.batch.extras, d.batch.response_mask
        if "old_logprobs" not in extras or "ref_logprobs" not in extras:
            raise ValueError("a KL penalty in the reward needs old logprobs and ref_logprobs")
        full = d.models.full_policy_logprobs  # the KL is on untruncated distributions
        policy_lp = extras["old_logprobs"] if full is None else full(d.batch)
        turn_rewards = turn_reward_tensor(d.trajectories, mask)
        base = sequence_rewards_to_token_level(d.rewards, mask) if turn_rewards is None else turn_rewards
        coef = self.alg.kl_loss_coef if self.coef is None else self.coef
        estimator = self.alg.kl_estimator_type
        if self.distillation:  # the teacher (reference) is the reward
            base, coef, estimator = torch.zeros_like(base), 1.0, "k1"
        d.scores, kl_metrics = apply_kl_penalty(
            base, policy_lp, extras["ref_logprobs"], mask, coef, estimator
        )
        d.metrics.update({f"kl_in_reward/{k}": v for k, v in kl_metrics.items()})


@dataclass(frozen=True)
class Advantages:
    """The advantages (and the critic's returns) by `advantage_estimator` (`grpo_norm_by_std`,
    `gamma`, `lambd`), whitened over the batch with `advantage_batch_normalize`."""

    alg: AlgorithmConfig

    def __call__(self, d: Draft) -> None:
        a, mask = self.alg, d.batch.response_mask
        if is_step_wise(d.trajectories):  # each turn a sample: the rollout's last step's advantage for all
            check_step_wise(a.advantage_estimator, a.use_kl_in_reward)
            advantages, returns = step_wise_advantages(
                a.advantage_estimator, d.rewards, mask, d.trajectories, a.grpo_norm_by_std
            )
        else:
            advantages, returns = compute_advantages(
                a.advantage_estimator,
                d.base_scores() if d.scores is None else d.scores,
                mask,
                group_ids=[tr.uid for tr in d.trajectories],
                values=d.batch.extras.get("values"),
                gamma=a.gamma,
                lambd=a.lambd,
                norm_by_std=a.grpo_norm_by_std,
            )
        if a.advantage_batch_normalize:
            advantages = masked_whiten(advantages, mask, 1e-6)
        d.batch = d.batch.with_extras(advantages=advantages)
        if d.models.values is not None:
            d.batch = d.batch.with_extras(returns=returns)


@dataclass(frozen=True)
class ExperienceStages:
    """The stages of experience making and what the batch is padded with (`from_config`)."""

    staleness: StalenessPolicy
    rewards: RewardShaping
    kl: KLInReward
    advantages: Advantages
    pad_token_id: int = 0

    @classmethod
    def of(
        cls,
        algorithm: AlgorithmConfig | None = None,
        staleness: StalenessPolicy | None = None,
        max_response_len: int = 0,
        pad_token_id: int = 0,
    ) -> ExperienceStages:
        """The stages of a `trainer.algorithm` group (default: the defaults) and a staleness policy."""
        alg = algorithm or AlgorithmConfig()
        return cls(
            staleness or StalenessPolicy(),
            RewardShaping(alg, max_response_len),
            KLInReward(alg),
            Advantages(alg),
            pad_token_id,
        )

    @classmethod
    def from_config(cls, cfg: SkyliftConfig, pad_token_id: int) -> ExperienceStages:
        return cls.of(
            cfg.trainer.algorithm,
            StalenessPolicy.from_config(cfg.trainer),
            cfg.generator.sampling_params.max_generate_length,
            pad_token_id,
        )

    def with_kl_coef(self, coef: float) -> ExperienceStages:
        """These stages with this step's KL-in-reward coefficient."""
        return dataclasses.replace(self, kl=dataclasses.replace(self.kl, coef=coef))

    def in_order(self) -> tuple[Stage, ...]:
        """What `make_experience` runs, in this order."""
        return (
            Staleness(self.staleness),  # the bound: raises before any model is called
            self.rewards,  # overlong penalty, zero-variance filter (the mask the models see)
            ModelQuantities(self.staleness),  # old logprobs (staleness policy), ref logprobs, values
            self.kl,  # KL penalty in the reward / on-policy distillation
            self.advantages,  # the estimator, batch whitening, the critic's returns
        )


@dataclass
class Experience:
    """A training batch (per-token extras above) with the per-sequence rewards and step metrics."""

    batch: SequenceBatch
    rewards: Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def trajectory_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> SequenceBatch:
    """Padded prompt + response ids of the trajectories, with their rollout logprobs and each
    row's image inputs (a vision-language model's) and routed experts (routing replay)."""
    batch = build_sequence_batch(
        [tr.prompt_ids for tr in trajectories],
        [tr.response_ids for tr in trajectories],
        [tr.loss_mask for tr in trajectories],
        pad_token_id=pad_token_id,
        per_token={"rollout_logprobs": [tr.rollout_logprobs for tr in trajectories]},
    )
    batch.row_inputs = row_inputs([routing_row(tr.vision_inputs, tr.routed_experts) for tr in trajectories])
    return batch


def make_experience(
    trajectories: Sequence[Trajectory],
    stages: ExperienceStages,
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
    draft = Draft(
        trajectories,
        policy_version,
        trajectory_batch(trajectories, stages.pad_token_id),
        torch.tensor([tr.reward for tr in trajectories], dtype=torch.float32),
        Models(policy_logprobs, ref_logprobs, values, full_policy_logprobs),
    )
    for stage in stages.in_order():
        stage(draft)
    draft.metrics.update(_batch_metrics(draft, stages.staleness))
    return Experience(batch=draft.batch, rewards=draft.rewards, metrics=draft.metrics)


def _batch_metrics(d: Draft, staleness: StalenessPolicy) -> dict[str, float]:
    trajectories, batch, mask = d.trajectories, d.batch, d.batch.response_mask
    lengths = [tr.num_generated_tokens for tr in trajectories]
    metrics = {
        "reward/mean": float(d.rewards.mean()),
        "reward/std": float(d.rewards.std()) if len(d.rewards) > 1 else 0.0,
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": float(max(lengths)),
        "response/truncated_frac": sum(tr.stop_reason != "stop" for tr in trajectories) / len(trajectories),
        "advantages/abs_mean": float(batch.extras["advantages"].abs().sum() / mask.sum().clamp(min=1)),
        **rollout_metrics(trajectories),
        **plugin_metrics(MetricsRequest(trajectories)),  # the metrics plugins' figures (generate/*)
    }
    if staleness.old_logprobs == "trainer":
        # how far the trainer's logprobs of the sampled tokens are from the engine's, before any
        # update of this step (the update's own figure sees already-updated weights after its
        # first mini-batch)
        diff = (batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]).abs() * mask
        metrics["policy/logprob_diff_vs_rollout"] = float(diff.sum() / mask.sum().clamp(min=1))
    return metrics
