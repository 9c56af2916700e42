"""Which prompts a training step generates.

`StepRows` maps a global step to its rows (the seeded epoch order, resumable at any step; a
prompt's position in it is what a fully async checkpoint records) and, for dynamic sampling, to
the step's own seeded draws of extra prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from skylift.data import PromptSample
from skylift.rl.dynamic_sampling import step_rows
from skylift.rl.parts import PromptData


@dataclass
class StepRows:
    """The training data as steps: `batch(step)` is the step's `batch_size` rows."""

    data: PromptData
    batch_size: int
    seed: int
    shuffle: bool = True
    epochs: int = 1
    oversample: int = 0
    """Extra prompts of the step's own draw generated with its first round (dynamic sampling's
    `gen_batch_size - train_batch_size`)."""

    @property
    def per_epoch(self) -> int:
        return self.data.num_batches(self.batch_size)

    @property
    def total(self) -> int:
        """Steps in all epochs."""
        return self.per_epoch * self.epochs

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of global step `step`."""
        if self.per_epoch == 0:
            raise ValueError(
                f"a dataset of {len(self.data)} prompts gives no full batch of {self.batch_size}"
            )
        return divmod(step, self.per_epoch)

    def batch(self, step: int) -> list[PromptSample]:
        epoch, index = self.locate(step)
        order = self.data.epoch_order(epoch, self.seed, self.shuffle)
        return [self.data[int(i)] for i in order[index * self.batch_size : (index + 1) * self.batch_size]]

    def first_round(self, step: int) -> list[PromptSample]:
        """The step's batch plus `oversample` more prompts of its own draw."""
        rows = self.batch(step)
        if self.oversample <= 0:
            return rows
        return [*rows, *self.draw(step, 0, self.oversample, {row.uid for row in rows})]

    def draw(self, step: int, start: int, count: int, taken: set[str]) -> list[PromptSample]:
        """Rows `start..start + count` of step `step`'s seeded draw, skipping the prompt uids
        `taken` (see `dynamic_sampling.step_rows`)."""
        data = self.data
        index = step_rows(len(data), self.seed, step, start, count, lambda i: data[i].uid in taken)
        return [data[i] for i in index]

    def at(self, position: int) -> tuple[PromptSample, int]:
        """The row at `position` of the run's data order (`step * batch_size + index` in the
        step's batch) and its step."""
        step, index = divmod(position, self.batch_size)
        return self.batch(step)[index], step

    def stream(self, start: int, end: int) -> Iterator[tuple[PromptSample, int]]:
        """The rows at positions `start` to `end` (excluded) of the data order, each with its step."""
        for step in range(start // self.batch_size, min(self.total, -(-end // self.batch_size))):
            for index, row in enumerate(self.batch(step)):
                if start <= step * self.batch_size + index < end:
                    yield row, step
