"""A training rank of reward-model training (`skylift sft objective=reward`).

`RewardWorker` is the supervised rank (`SupervisedWorker`: the same FSDP2 sharding, LoRA, optimizer
and checkpoints) over a reward model (`skylift.models.reward_model`: the backbone with a scalar
head on the last non-pad token, transformers' ``*ForSequenceClassification``) instead of a causal
LM. It trains on preference pairs with the Bradley-Terry loss (`skylift.algorithms.reward_model`)
and scores rows. A pair's two rows stay in one micro-batch, so each micro-batch's loss is its
pairs' terms divided by the step's pair count over all ranks: the accumulated gradient is the
step's mean loss's. Its Hugging Face export (`export_hf`) is a ``*ForSequenceClassification``
directory with ``num_labels=1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from skylift.algorithms.reward_model import pair_losses
from skylift.models.reward_model import load_reward_model, pad_id_of, right_padded, sequence_rewards
from skylift.worker.supervised import SupervisedWorker


@dataclass(frozen=True)
class RewardPairs:
    """Preference pairs as token rows: whole sequences (prompt and completion) and a margin each
    (None: no margin column)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float] | None = None

    def __len__(self) -> int:
        return len(self.chosen)

    def select(self, start: int, stop: int) -> RewardPairs:
        margins = self.margins[start:stop] if self.margins is not None else None
        return RewardPairs(self.chosen[start:stop], self.rejected[start:stop], margins)


class RewardWorker(SupervisedWorker):
    """A `SupervisedWorker` over a reward model (see the module docstring)."""

    def setup(self, base: torch.nn.Module | None = None) -> dict[str, Any]:
        s = self.settings
        if s.sequence_parallel_size > 1:
            raise ValueError("reward-model training does not split sequences: use sequence_parallel_size=1")
        if base is None:
            torch.manual_seed(s.seed)  # the new head's initialisation, as TRL's set_seed before loading
            base = load_reward_model(s.model_path, s.dtype)
        # the scalar head: LoRA leaves it out and trains it whole (`skylift.worker.lora`)
        self.settings = dataclasses.replace(s, head="value")
        return super().setup(base)

    def train_pairs(
        self, pairs: RewardPairs, total_pairs: int, micro_pairs: int, center_coefficient: float | None = None
    ) -> dict[str, Any]:
        """One optimizer step on this rank's `pairs` of a step of `total_pairs` pairs, `micro_pairs`
        pairs (two rows each) a forward pass. Returns the optimizer's figures and this rank's sums:
        ``loss_sum`` (of the pairs' losses), ``correct`` (chosen scored above rejected),
        ``chosen_sum``/``rejected_sum`` (of the rewards)."""
        model = self._model()
        self.zero_grad()
        model.train()
        sums = {"loss_sum": 0.0, "correct": 0.0, "chosen_sum": 0.0, "rejected_sum": 0.0}
        for start in range(0, len(pairs), max(micro_pairs, 1)):
            micro = pairs.select(start, start + micro_pairs)
            chosen, rejected = self._rewards(micro)
            margin = torch.tensor(micro.margins, device=chosen.device) if micro.margins is not None else None
            losses = pair_losses(chosen, rejected, margin, center_coefficient)
            loss = losses.sum() / max(total_pairs, 1)
            if self.world_size > 1:  # FSDP averages the ranks' gradients
                loss = loss * self.world_size
            loss.backward()
            sums["loss_sum"] += float(losses.detach().sum())
            sums["correct"] += float((chosen > rejected).sum())
            sums["chosen_sum"] += float(chosen.detach().sum())
            sums["rejected_sum"] += float(rejected.detach().sum())
        metrics: dict[str, Any] = dict(self.optimizer_step())
        metrics.update(sums)
        return metrics

    @torch.no_grad()
    def score_pairs(self, pairs: RewardPairs, micro_pairs: int) -> tuple[list[float], list[float]]:
        """(chosen rewards, rejected rewards) of `pairs`, no gradient."""
        model = self._model()
        was_training = model.training
        model.eval()
        chosen: list[float] = []
        rejected: list[float] = []
        for start in range(0, len(pairs), max(micro_pairs, 1)):
            c, r = self._rewards(pairs.select(start, start + micro_pairs))
            chosen += c.cpu().tolist()
            rejected += r.cpu().tolist()
        model.train(was_training)
        return chosen, rejected

    def _rewards(self, micro: RewardPairs) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and the rejected rows' rewards of one micro-batch (rows chosen first, as
        TRL's collator orders them)."""
        model = self._model()
        ids, mask = right_padded(micro.chosen + micro.rejected, pad_id_of(model))
        with self._autocast():
            rewards = sequence_rewards(model, ids.to(self.device), mask.to(self.device))
        return rewards[: len(micro)], rewards[len(micro) :]


__all__ = ["RewardPairs", "RewardWorker"]
