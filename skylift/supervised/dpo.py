"""Preference training (`skylift sft objective=dpo`): DPO or IPO on the supervised trainer's ranks.

`PreferenceTrainer` is the `SupervisedTrainer` with pairs for rows (`skylift.supervised.preference`).
Before the first step a frozen reference group of the same ranks (the base model, no adapter)
scores every pair's completions once and goes away: the reference logprobs are precomputed. Each
step scores its pairs with the policy without gradient, takes the loss and its derivatives, and has
the ranks backpropagate the supervised loss weighted by them (`WeightedObjective`) and step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from skylift.supervised.pair_trainer import PairTrainer
from skylift.supervised.preference import PairRow, WeightedObjective, dpo_loss, pair_batch, pair_of
from skylift.worker.supervised import SupervisedWorker


class PreferenceTrainer(PairTrainer):
    """DPO / IPO (see the module docstring); `run()` returns the per-step losses."""

    def pair_of(self, row: dict[str, Any], template_kwargs: dict[str, Any], where: str) -> PairRow:
        return pair_of(row, self.tokenizer, template_kwargs, where)

    def start(self) -> None:
        super().start()
        started = time.perf_counter()
        ref = self.worker_group("ref", trainable=False)
        ref.setup()
        try:
            self.ref_logps: dict[int, tuple[float, float]] = {}
            everything = [p for source in self.batches.sources for p in source]
            everything += [p for rows in self.eval_data.values() for p in rows]
            size = self.cfg.batch_size
            for i in range(0, len(everything), size):
                chunk = everything[i : i + size]
                sums, _ = self._scores(ref, chunk)
                n = len(chunk)
                for j, pair in enumerate(chunk):
                    self.ref_logps[id(pair)] = (float(sums[j]), float(sums[n + j]))
        finally:
            ref.shutdown()
        self.say(f"reference logprobs of {len(everything)} pairs in {time.perf_counter() - started:.1f} s")

    def _scores(self, group: Any, pairs: Sequence[PairRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(completion logprob sums, completion lengths) of the `2n` rows of `pairs` under `group`."""
        batch = pair_batch(pairs, self.pad_id)
        logp = group.compute_logprobs(batch, self.cfg.micro_train_batch_size_per_gpu, 1.0)
        return (logp * batch.response_mask).sum(-1), batch.response_mask.sum(-1)

    def _loss(self, pairs: Sequence[PairRow]) -> tuple[float, torch.Tensor, dict[str, float]]:
        sums, lengths = self._scores(self._group(), pairs)
        ref = torch.tensor(
            [self.ref_logps[id(p)][0] for p in pairs] + [self.ref_logps[id(p)][1] for p in pairs]
        )
        return dpo_loss(sums, ref, lengths, self.cfg.dpo_loss, self.cfg.dpo_beta)

    def train_step(self, rows: Sequence[Any]) -> dict[str, float]:
        group = self._group()
        started = time.perf_counter()
        loss, grad, metrics = self._loss(rows)
        batch = pair_batch(rows, self.pad_id)
        batch = batch.with_extras(weights=-grad[:, None] * batch.response_mask)
        shards = group.shards(batch) if group.world_size > 1 else [batch]
        mb = self.cfg.micro_train_batch_size_per_gpu
        results = group.call_each(SupervisedWorker.train_step, [(s, WeightedObjective(), mb) for s in shards])
        seconds = time.perf_counter() - started
        tokens = int(batch.attention_mask.sum())
        return {
            "loss": loss,
            **metrics,
            "grad_norm": float(results[0]["grad_norm"]),
            "lr": float(results[0]["lr"]),
            "loss_tokens": float(batch.response_mask.sum()),
            "tokens": float(tokens),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "step_s": seconds,
        }

    def eval_loss(self, rows: Sequence[Any]) -> float:
        size, total = self.cfg.batch_size, 0.0
        for i in range(0, len(rows), size):
            chunk = rows[i : i + size]
            total += self._loss(chunk)[0] * len(chunk)
        return total / max(len(rows), 1)


__all__ = ["PreferenceTrainer"]
