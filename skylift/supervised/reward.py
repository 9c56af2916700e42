"""Reward-model training (`skylift sft objective=reward`): Bradley-Terry on preference pairs.

Rows in TRL's preference format, as `RewardTrainer` reads them: ``chosen`` and ``rejected``
conversations (lists of messages) or strings, with an optional ``prompt`` put before both, an
optional ``tools`` column for the chat template and an optional ``margin`` per pair. A conversation
is the chat template's rendering of prompt + completion (no generation prompt); a string is
tokenized with the EOS appended when it does not end with it. Pairs longer than ``max_length``
(either side) are left out, as TRL filters them.

`RewardModelTrainer` is the `SupervisedTrainer` on `RewardWorker` ranks (the model gets a scalar
head, `skylift.models.reward_model`): each step splits its pairs evenly over the ranks, each rank
takes its share of the step's mean loss (`skylift.algorithms.reward_model`), and the export is a
``*ForSequenceClassification`` directory that ``AutoModelForSequenceClassification`` loads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skylift.algorithms.reward_model import pair_losses
from skylift.generator.chat import ChatFormat
from skylift.supervised.pair_trainer import PairTrainer
from skylift.supervised.preference import PreferenceDataError, ending_with_eos, preference_columns
from skylift.worker.reward_head import RewardPairs, RewardWorker


@dataclass(frozen=True)
class RewardRow:
    """One preference pair as whole token sequences, and its margin (None: no margin column)."""

    chosen: list[int]
    rejected: list[int]
    margin: float | None = None


def reward_row_of(
    row: dict[str, Any], tokenizer: Any, template_kwargs: dict[str, Any] | None = None, where: str = "row"
) -> RewardRow:
    """A TRL-format preference row tokenized for a reward model (see the module docstring)."""
    prompt, chosen, rejected = preference_columns(row, where, "a reward-model row")
    margin = row.get("margin")
    if margin is not None and not isinstance(margin, int | float):
        raise PreferenceDataError(f"{where}: 'margin' must be a number, got {margin!r}")
    margin = None if margin is None else float(margin)
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str | None):

        def text(completion: str) -> list[int]:
            ids = tokenizer((prompt or "") + ending_with_eos(completion, tokenizer))["input_ids"]
            return [int(t) for t in ids]

        return RewardRow(text(chosen), text(rejected), margin)
    if not (isinstance(chosen, list) and isinstance(rejected, list) and isinstance(prompt, list | None)):
        raise PreferenceDataError(
            f"{where}: prompt, chosen and rejected must be message lists (or all strings)"
        )
    chat = ChatFormat(tokenizer, template_kwargs)
    tools = row.get("tools")
    first = list(prompt or [])
    return RewardRow(
        chat.render([*first, *chosen], add_generation_prompt=False, tools=tools),
        chat.render([*first, *rejected], add_generation_prompt=False, tools=tools),
        margin,
    )


def as_pairs(rows: Sequence[RewardRow]) -> RewardPairs:
    """Rows as the ranks take them; margins when any row has one (the others' are 0)."""
    margins = [r.margin or 0.0 for r in rows] if any(r.margin is not None for r in rows) else None
    return RewardPairs([r.chosen for r in rows], [r.rejected for r in rows], margins)


class RewardModelTrainer(PairTrainer):
    """Reward-model training (see the module docstring); `run()` returns the per-step losses."""

    worker_cls = RewardWorker

    def pair_of(self, row: dict[str, Any], template_kwargs: dict[str, Any], where: str) -> RewardRow:
        return reward_row_of(row, self.tokenizer, template_kwargs, where)

    def pair_length(self, pair: RewardRow) -> int:
        return max(len(pair.chosen), len(pair.rejected))

    def train_step(self, rows: Sequence[Any]) -> dict[str, float]:
        group = self._group()
        started = time.perf_counter()
        pairs = as_pairs(rows)
        n, world = len(pairs), group.world_size
        shards = [pairs.select(r * n // world, (r + 1) * n // world) for r in range(world)]
        mb = self.cfg.micro_train_batch_size_per_gpu
        coef = self.cfg.center_rewards_coefficient
        results = group.call_each(RewardWorker.train_pairs, [(s, n, mb, coef) for s in shards])
        seconds = time.perf_counter() - started
        tokens = float(sum(len(r.chosen) + len(r.rejected) for r in rows))

        def total(key: str) -> float:
            return sum(float(r[key]) for r in results)

        return {
            "loss": total("loss_sum") / n,
            "accuracy": total("correct") / n,
            "reward_chosen": total("chosen_sum") / n,
            "reward_rejected": total("rejected_sum") / n,
            "grad_norm": float(results[0]["grad_norm"]),
            "lr": float(results[0]["lr"]),
            "loss_tokens": tokens,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "step_s": seconds,
        }

    def _progress(self, step: int, m: dict[str, float]) -> None:
        width = len(str(self.total_steps))
        self.say(
            f"step {step:>{width}}/{self.total_steps} | loss {m['loss']:.4f} | accuracy {m['accuracy']:.2f} | "
            f"reward chosen {m['reward_chosen']:+.3f} rejected {m['reward_rejected']:+.3f} | lr {m['lr']:.2e} | "
            f"grad_norm {m['grad_norm']:.3f} | {int(m['tokens'])} tokens | {m['step_s']:.2f} s"
        )

    def eval_loss(self, rows: Sequence[Any]) -> float:
        """The mean Bradley-Terry loss of `rows` (no gradient; every rank scores the same pairs)."""
        import torch

        group = self._group()
        if not rows:
            return 0.0
        pairs = as_pairs(rows)
        mb = self.cfg.micro_train_batch_size_per_gpu
        chosen, rejected = group.call_each(RewardWorker.score_pairs, [(pairs, mb)] * group.world_size)[0]
        margin = torch.tensor(pairs.margins) if pairs.margins is not None else None
        losses = pair_losses(
            torch.tensor(chosen), torch.tensor(rejected), margin, self.cfg.center_rewards_coefficient
        )
        return float(losses.mean())


__all__ = ["RewardModelTrainer", "RewardRow", "as_pairs", "reward_row_of"]
