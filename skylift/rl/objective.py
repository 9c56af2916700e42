"""The policy objective handed to training workers: policy loss + optional KL loss, reduced.

A `PolicyObjective` is a small picklable callable (it travels to Ray actors); the worker calls it
on each micro-batch with the new logprobs. It reads the per-token tensors the trainer attached to
the batch (`advantages`, `rollout_logprobs`, and optionally `old_logprobs`, `ref_logprobs`). With
truncated sampling the new logprobs are those of the truncated distribution the engine sampled
from, and the KL loss reads the untruncated ones (the worker's `full_logprobs` extra), as the
reference's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from skylift.algorithms import (
    compute_kl,
    compute_policy_loss,
    compute_value_loss,
    masked_mean,
    reduce_loss,
)
from skylift.config.algorithm import AlgorithmConfig
from skylift.utils.plugins import import_user_modules
from skylift.worker.batch import SequenceBatch


@dataclass(frozen=True)
class PolicyObjective:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The ``trainer.algorithm`` group as it is: the loss (``policy_loss_type``, read with its
    settings by `compute_policy_loss`), ``loss_reduction``, the KL loss (``use_kl_loss``,
    ``kl_loss_coef``, ``kl_estimator_type``) and the modules registering a custom loss
    (``import_modules``, imported in the worker)."""
    max_len: int = 256  # L of seq_mean_token_sum_norm
    # totals of the whole mini-batch (over all ranks): set per mini-batch by the trainer
    token_count: float = 1.0
    seq_count: float = 1.0
    search_dir: str | None = None  # where the driver ran, for modules found there

    @property
    def needs_full_logprobs(self) -> bool:
        """The KL to the reference is taken on the untruncated distribution (see the worker)."""
        return self.algorithm.use_kl_loss

    def __call__(self, logprobs: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.response_mask.to(logprobs.dtype)
        extras = micro.extras
        old = extras.get("old_logprobs")
        if old is None:  # exactly on-policy: one update on freshly sampled data
            old = logprobs.detach()
        rollout = extras.get("rollout_logprobs")
        alg = self.algorithm
        import_user_modules(alg.import_modules, "trainer.algorithm.import_modules", self.search_dir)
        per_token, metrics = compute_policy_loss(
            alg.policy_loss_type, logprobs, old, extras["advantages"], mask, alg, rollout_logprobs=rollout
        )
        if alg.use_kl_loss:
            kl = compute_kl(
                extras.get("full_logprobs", logprobs), extras["ref_logprobs"], alg.kl_estimator_type
            )
            per_token = per_token + alg.kl_loss_coef * kl * mask
            metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
        loss = reduce_loss(
            per_token,
            mask,
            alg.loss_reduction,
            global_token_count=self.token_count,
            global_seq_count=self.seq_count,
            max_len=self.max_len,
        )
        with torch.no_grad():
            metrics["policy_loss"] = float(masked_mean(per_token.detach(), mask))
            if rollout is not None:
                metrics["logprob_diff_vs_rollout"] = float(
                    masked_mean((logprobs.detach() - rollout).abs(), mask)
                )
        return loss, metrics


@dataclass(frozen=True)
class ValueObjective:
    """The critic's objective (advantage_estimator=gae): clipped squared error to the GAE returns,
    averaged over the mini-batch's tokens. Reads `values` (old) and `returns` from the batch."""

    value_clip: float = 0.2
    token_count: float = 1.0  # tokens of the whole mini-batch (over all ranks)

    def __call__(self, values: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.response_mask.to(values.dtype)
        per_token, metrics = compute_value_loss(
            values, micro.extras["values"], micro.extras["returns"], mask, self.value_clip
        )
        loss = reduce_loss(per_token, mask, "token_mean", global_token_count=self.token_count)
        return loss, metrics


def rows_with_policy_gradient(advantages: Tensor, mask: Tensor, min_rows: int = 1) -> list[int]:
    """Rows whose policy-loss gradient can be non-zero: some response token has a non-zero advantage.

    Every policy loss here is a product with the advantage, so a row whose advantages are all zero
    (a GRPO group whose samples got the same reward) contributes exactly zero gradient, whatever its
    importance ratio, as long as no KL loss is added. Training on the other rows only, normalised by
    the whole mini-batch's token and sequence counts, gives the same update for a fraction of the
    compute. At least `min_rows` rows are kept (zero-advantage ones if needed) so that every rank
    has work and the optimizer sees zero gradients rather than none (AdamW skips parameters without
    a gradient, but steps its moments on a zero one).
    """
    has_signal = ((advantages != 0) & (mask > 0)).any(dim=-1).tolist()
    keep = [i for i, signal in enumerate(has_signal) if signal]
    fill = [i for i, signal in enumerate(has_signal) if not signal][: max(0, min_rows - len(keep))]
    return sorted(keep + fill)
