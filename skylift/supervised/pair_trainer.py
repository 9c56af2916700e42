"""The supervised trainer over preference pairs (DPO's, a reward model's): rows read one by one."""

from __future__ import annotations

from typing import Any

from skylift.data.chat import read_rows
from skylift.supervised.trainer import SupervisedTrainer


class PairTrainer(SupervisedTrainer):
    """A `SupervisedTrainer` whose rows are preference pairs: `pair_of` makes one of each row of
    every dataset; a pair whose `pair_length` is over ``max_length`` is left out (and counted)."""

    def load_train(self) -> list[list[Any]]:
        return self.read_each_source(self._pairs)

    def load_eval(self) -> dict[str, list[Any]]:
        return self.read_each_eval_source(self._pairs)

    def pair_of(self, row: dict[str, Any], template_kwargs: dict[str, Any], where: str) -> Any:
        """The pair of the dataset row `row` (`where` names it in errors)."""
        raise NotImplementedError

    def pair_length(self, pair: Any) -> int | None:
        """The length ``max_length`` bounds (None: the pair is kept whatever its length)."""
        return None

    def _pairs(self, source: str, split: str | None) -> list[Any]:
        kwargs = dict(self.cfg.chat_template_kwargs)
        pairs = [self.pair_of(r, kwargs, f"{source} row {i}") for i, r in enumerate(read_rows(source, split))]
        limit = self.cfg.max_length
        kept = [p for p in pairs if limit is None or (self.pair_length(p) or 0) <= limit]
        dropped = (
            f", {len(pairs) - len(kept)} longer than max_length={limit} left out"
            if len(kept) < len(pairs)
            else ""
        )
        self.say(f"{source}: {len(kept)} preference pairs{dropped}")
        return kept
