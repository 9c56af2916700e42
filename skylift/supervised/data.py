"""The rows of a supervised run and the order they are trained in.

Every source (file or Hub dataset) is read and tokenized once (`skylift.supervised.tokens`). The
batch of step ``s`` is a function of the seed and ``s`` alone, so a run resumed at step ``s`` sees
the batches the interrupted one would have seen:

- one source, or several without weights: the rows of all sources in one pool; epoch ``e`` is a
  permutation drawn from ``(seed, e)`` (file order with ``shuffle=false``), cut into batches (the
  last partial batch of an epoch is dropped);
- several sources with ``train_dataset_weights``: each batch takes from each source its share of
  the batch by weight (largest remainders, ties drawn from ``(seed, step)``); each source is read
  in its own seeded permutations, one after the other, so every row is used before any repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from skylift.supervised.tokens import TokenizedRow
from skylift.worker.batch import SequenceBatch, build_sequence_batch


def _permutation(n: int, seed: int, *key: int, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, *key]).permutation(n)


@dataclass
class StepBatches:
    """The rows of each step (see the module docstring)."""

    sources: Sequence[Sequence[TokenizedRow]]
    batch_size: int
    seed: int = 42
    shuffle: bool = True
    weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        self.total_rows = sum(len(s) for s in self.sources)
        if self.total_rows < self.batch_size:
            raise ValueError(f"{self.total_rows} train rows are fewer than batch_size={self.batch_size}")
        self.pool = [row for source in self.sources for row in source]

    @property
    def steps_per_epoch(self) -> int:
        return self.total_rows // self.batch_size

    def rows(self, step: int) -> list[TokenizedRow]:
        if self.weights is None or len(self.sources) == 1:
            epoch, k = divmod(step, self.steps_per_epoch)
            order = _permutation(len(self.pool), self.seed, epoch, shuffle=self.shuffle)
            return [self.pool[int(i)] for i in order[k * self.batch_size : (k + 1) * self.batch_size]]
        cursors = [0] * len(self.sources)
        for earlier in range(step):
            for s, c in enumerate(self._counts(earlier)):
                cursors[s] += c
        out: list[TokenizedRow] = []
        for s, count in enumerate(self._counts(step)):
            out += [self._row(s, cursors[s] + j) for j in range(count)]
        return out

    def _counts(self, step: int) -> list[int]:
        """How many rows each source gives to `step`'s batch."""
        assert self.weights is not None
        w = np.asarray(self.weights, dtype=float)
        share = w / w.sum() * self.batch_size
        counts = np.floor(share).astype(int)
        rest = self.batch_size - int(counts.sum())
        if rest:
            frac = share - counts
            rng = np.random.default_rng([self.seed, step, 7])
            picked = rng.choice(len(w), size=rest, replace=False, p=frac / frac.sum())
            counts[picked] += 1
        return [int(c) for c in counts]

    def _row(self, source: int, index: int) -> TokenizedRow:
        rows = self.sources[source]
        lap, k = divmod(index, len(rows))
        return rows[int(_permutation(len(rows), self.seed, source, lap, shuffle=self.shuffle)[k])]


def sequence_batch(rows: Sequence[TokenizedRow], pad_token_id: int) -> SequenceBatch:
    """Rows as a `SequenceBatch`: the first token as the prompt, the rest as the response with the
    loss mask (a token's logprob is predicted from the tokens before it)."""
    return build_sequence_batch(
        [r.ids[:1] for r in rows],
        [r.ids[1:] for r in rows],
        [r.loss_mask[1:] for r in rows],
        pad_token_id=pad_token_id,
    )


def loss_tokens(rows: Sequence[TokenizedRow]) -> int:
    return sum(r.loss_tokens for r in rows)


__all__ = ["StepBatches", "loss_tokens", "sequence_batch"]
