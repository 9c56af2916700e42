"""The update: a training batch -> optimizer steps of the policy (and the critic), per mini-batch.

Model-free: the workers come in as anything with `train_mini_batch` (a `WorkerGroup`), the loss as
a `PolicyObjective` / `ValueObjective` whose mini-batch totals are filled in here.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from skylift.algorithms import mini_batch_totals
from skylift.algorithms.sample_support import Sampling
from skylift.config.schema import SkyliftConfig
from skylift.generator.settings import max_generate_length
from skylift.inference.types import SamplingParams
from skylift.rl.objective import PolicyObjective, ValueObjective, rows_with_policy_gradient
from skylift.rl.sampling import trainer_distribution
from skylift.utils.plugins import import_user_modules
from skylift.worker.batch import SequenceBatch


class TrainsMiniBatches(Protocol):
    world_size: int

    def train_mini_batch(
        self, batch: SequenceBatch, loss_fn: Any, micro_batch_size: int, temperature: Sampling
    ) -> dict[str, float]: ...


@dataclass(frozen=True)
class UpdateSettings:
    """How a batch is cut and trained (`from_config`)."""

    rows_per_mini_batch: int
    critic_rows_per_mini_batch: int
    epochs: int = 1
    micro_batch_size: int = 1
    temperature: Sampling = 1.0  # the distribution the policy's logprobs are taken under
    skip_zero_advantage_rows: bool = False
    value_clip: float = 0.2

    @classmethod
    def from_config(cls, cfg: SkyliftConfig, request: SamplingParams) -> UpdateSettings:
        """`request`: the training rollouts' request (the training `Sampler`'s own object); the
        policy's logprobs are taken under its distribution (`skylift.rl.sampling.trainer_distribution`)."""
        t, alg, n = cfg.trainer, cfg.trainer.algorithm, cfg.generator.n_samples_per_prompt
        return cls(
            rows_per_mini_batch=t.policy_mini_batch_size * n,
            critic_rows_per_mini_batch=t.critic_mini_batch_size * n,
            epochs=t.update_epochs_per_batch,
            micro_batch_size=t.micro_train_batch_size_per_gpu,
            temperature=trainer_distribution(request, alg.enable_sample_support_replay),
            skip_zero_advantage_rows=t.skip_zero_advantage_rows and not alg.use_kl_loss,
            value_clip=alg.value_clip,
        )


def policy_objective(cfg: SkyliftConfig) -> PolicyObjective:
    """The policy loss: the `trainer.algorithm` group as it is, which the loss functions
    (`skylift.algorithms`, SkyRL's custom losses) read under SkyRL's nested names; mini-batch totals
    are filled in per mini-batch; L of seq_mean_token_sum_norm defaults to the response budget."""
    alg = cfg.trainer.algorithm
    # the driver computes advantages with what these register, the workers the loss
    import_user_modules(alg.import_modules, "trainer.algorithm.import_modules")
    return PolicyObjective(
        algorithm=alg,
        search_dir=os.getcwd() if alg.import_modules else None,
        max_len=alg.max_seq_len or max_generate_length(cfg),
    )


def mini_batches(batch: SequenceBatch, rows: int, epochs: int) -> Iterator[SequenceBatch]:
    """`epochs` passes over `batch` in order, `rows` rows at a time (the last one may be shorter)."""
    for _ in range(epochs):
        for start in range(0, batch.batch_size, rows):
            yield batch.select(list(range(start, min(start + rows, batch.batch_size))))


def pad_rows(batch: SequenceBatch, multiple: int) -> SequenceBatch:
    """`batch` with copies of its last row added up to a multiple of `multiple` rows, their response
    masks zeroed: no loss, no gradient, and not counted (the mini-batch totals are taken before).

    Every worker then gets the same number of rows, hence of micro-batches: FSDP's collectives
    (all-gathers in each forward, reduce-scatters in each backward) must match across ranks. A
    policy mini-batch that does not split evenly over the workers (e.g. 20 sequences over 8
    workers) trains as its sequences would, padded with rows that carry no loss.
    """
    extra = -batch.batch_size % multiple
    if extra == 0 or batch.batch_size == 0:
        return batch
    padded = batch.select([*range(batch.batch_size), *[batch.batch_size - 1] * extra])
    mask = padded.response_mask.clone()
    mask[batch.batch_size :] = 0
    return dataclasses.replace(padded, response_mask=mask)


def train_policy(
    policy: TrainsMiniBatches, batch: SequenceBatch, objective: PolicyObjective, s: UpdateSettings
) -> dict[str, float]:
    """One optimizer step per mini-batch; the loss is normalised by the whole mini-batch's token
    and sequence counts, also when rows without a policy gradient are skipped."""
    sums: dict[str, list[float]] = defaultdict(list)
    trained_rows = 0
    for mini in mini_batches(batch, s.rows_per_mini_batch, s.epochs):
        totals = mini_batch_totals(mini.response_mask)  # of the whole mini-batch, kept rows or not
        step_objective = dataclasses.replace(
            objective, token_count=max(1, totals.token_count), seq_count=max(1, totals.seq_count)
        )
        if s.skip_zero_advantage_rows:
            mini = mini.select(
                rows_with_policy_gradient(mini.extras["advantages"], mini.response_mask, policy.world_size)
            )
        trained_rows += mini.batch_size
        mini = pad_rows(mini, policy.world_size)
        for k, v in policy.train_mini_batch(mini, step_objective, s.micro_batch_size, s.temperature).items():
            sums[k].append(v)
    metrics = {f"policy/{k}": statistics.fmean(v) for k, v in sums.items()}
    metrics["train/rows_trained_frac"] = trained_rows / (batch.batch_size * s.epochs)
    if sums.get("logprob_diff_vs_rollout"):
        # the first mini-batch's figure is the only one measured before any update of this step
        metrics["policy/logprob_diff_vs_rollout"] = sums["logprob_diff_vs_rollout"][0]
    return metrics


def train_critic(critic: TrainsMiniBatches, batch: SequenceBatch, s: UpdateSettings) -> dict[str, float]:
    """Fit the critic to the batch's GAE returns, one optimizer step per critic mini-batch."""
    sums: dict[str, list[float]] = defaultdict(list)
    for mini in mini_batches(batch, s.critic_rows_per_mini_batch, s.epochs):
        objective = ValueObjective(
            value_clip=s.value_clip, token_count=max(1, mini_batch_totals(mini.response_mask).token_count)
        )
        for k, v in critic.train_mini_batch(mini, objective, s.micro_batch_size, 1.0).items():
            sums[k].append(v)
    return {f"critic/{k}": statistics.fmean(v) for k, v in sums.items()}
