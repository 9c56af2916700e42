"""The loss `skylift sft` hands its ranks: token-mean negative log-likelihood over the step.

Each micro-batch contributes ``sum(-logp * mask) / token_count``, where `token_count` is the
number of target tokens in the whole optimizer step over every rank, so the accumulated gradient is
that of the step's token mean (what TRL's `SFTTrainer` and transformers' `Trainer` compute with
gradient accumulation). The per-token term is `skylift.algorithms.supervised.cross_entropy`, the
one the Tinker service's ``cross_entropy`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from skylift.algorithms.supervised import cross_entropy
from skylift.worker.batch import SequenceBatch


@dataclass
class SupervisedObjective:
    """A picklable loss function for `TrainingWorker.accumulate_gradients` (see the module)."""

    token_count: float
    #: what this process saw: [sum of -logp over targets, target tokens] (read by `SupervisedWorker`)
    totals: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __call__(self, logprobs: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.response_mask.to(logprobs.dtype)
        total = cross_entropy(logprobs, mask).sum()
        self.totals[0] += float(total.detach())
        self.totals[1] += float(mask.sum())
        return total / max(self.token_count, 1.0), {}


__all__ = ["SupervisedObjective"]
