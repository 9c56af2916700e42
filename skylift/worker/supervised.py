"""A training rank of the supervised stages: one optimizer step on a batch of token sequences,
returning the loss's exact sums, and the evaluation loss.

`SupervisedWorker` is a `TrainingWorker` (the same FSDP2 rank the RL trainer drives, with the same
host offload, `worker.offload`: the worker group calls both through the RL worker's methods) with two
methods that report the sums of the step's loss (negative log-likelihood and target tokens) so the
driver can add them over ranks exactly, where the training worker reports per micro-batch means.
"""

from __future__ import annotations

from typing import Any

from skylift.worker.batch import SequenceBatch
from skylift.worker.offload import OffloadingWorker
from skylift.worker.training_worker import LossFn, TrainingWorker


class SupervisedWorker(OffloadingWorker, TrainingWorker):
    """A `TrainingWorker` for `skylift sft` (see the module docstring)."""

    # every supervised loss (and `eval_nll`) reads the target tokens only: packed passes leave the
    # others' logits uncomputed (the unembedding is a fifth of a small model's work per token)
    targets_only = True

    def train_step(self, batch: SequenceBatch, objective: LossFn, micro_batch_size: int) -> dict[str, Any]:
        """Zero the gradients, backpropagate `objective` over micro-batches, clip and step. The
        objective counts what it saw (its ``totals``: loss sum, target tokens) in this process."""
        self.zero_grad()
        self.accumulate_gradients(batch, objective, micro_batch_size)
        metrics: dict[str, Any] = dict(self.optimizer_step())
        totals = getattr(objective, "totals", [0.0, 0.0])
        metrics["nll_sum"], metrics["loss_tokens"] = float(totals[0]), float(totals[1])
        return metrics

    def eval_nll(self, batch: SequenceBatch, micro_batch_size: int) -> tuple[float, float]:
        """(negative log-likelihood summed over the targets of `batch`, their count), no gradient."""
        logp = self.compute_logprobs(batch, micro_batch_size)
        mask = batch.response_mask
        return float(-(logp * mask).sum()), float(mask.sum())


__all__ = ["SupervisedWorker"]
