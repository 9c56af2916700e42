"""Where a reward model scores rollouts for the ``reward_model`` environment (its scorers).

A scorer turns conversations into rewards: `RewardScorer.score_conversations` renders each with the
reward model's chat template (token ids, as ``skylift sft objective=reward`` rendered its pairs,
no generation prompt) and scores the rows with `score_rows`, which the backends implement:

- ``local``, `TorchScorer`: the model (`skylift.models.reward_model`) in this process, one call
  at a time;
- ``actor``, `RayActorScorer`: the torch model (`TorchModel`) in a Ray actor, with 0 CPUs reserved
  (it shares the run's) and Ray's one torch thread; Ray is started if this process has none;
- ``vllm``: a vLLM pooling engine (`skylift.inference.reward_pooling`).

The environment (`skylift.envs.reward_model`) reaches them through its `SCORER_FACTORIES` hook.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from skylift.envs.reward_model import SCORER_FACTORIES, RewardModelScorer


class RewardScorer(ABC):
    """Conversations -> rewards through `score_rows` (a subclass's); `RewardModelScorer` of
    `skylift.envs.reward_model`."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from skylift.models import resolve_model_path

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))

    def render(self, conversation: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=False, return_dict=False
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def score_conversations(self, conversations: Sequence[list[dict[str, Any]]]) -> list[float]:
        return self.score_rows([self.render(c) for c in conversations])

    @abstractmethod
    def score_rows(self, rows: list[list[int]]) -> list[float]:
        """One reward per token row."""

    def close(self) -> None:  # noqa: B027 - a scorer in this process has nothing to release
        """Release the model (nothing here)."""


class TorchModel:
    """A reward model in torch, scoring token rows (`score_rows`) one call at a time."""

    def __init__(self, path: str, batch_size: int) -> None:
        from skylift.models.reward_model import load_reward_model

        self.model = load_reward_model(path).eval()
        self.model.requires_grad_(False)
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def score_rows(self, rows: list[list[int]]) -> list[float]:
        from skylift.models.reward_model import score_rows

        with self._lock:
            return score_rows(self.model, rows, self.batch_size)


class TorchScorer(RewardScorer):
    """The model in this process."""

    def __init__(self, path: str, batch_size: int) -> None:
        super().__init__(path)
        self.model = TorchModel(path, batch_size)

    def score_rows(self, rows: list[list[int]]) -> list[float]:
        return self.model.score_rows(rows)


class RayActorScorer(RewardScorer):
    """The model in a Ray actor (Ray is started here if this process has none)."""

    def __init__(self, path: str, batch_size: int) -> None:
        import ray

        super().__init__(path)
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        # Ray gives an actor without CPUs one torch thread (OMP_NUM_THREADS=1): on this loaded
        # 2-core machine, faster than a thread per core (benchmarks/reward_model_scoring.py)
        self.actor = ray.remote(num_cpus=0)(TorchModel).remote(path, batch_size)

    def score_rows(self, rows: list[list[int]]) -> list[float]:
        import ray

        return list(ray.get(self.actor.score_rows.remote(rows)))  # the caller bounds the wait

    def close(self) -> None:
        import ray

        if ray.is_initialized():  # else the actor ended with its Ray session
            try:
                ray.kill(self.actor)
            except ray.exceptions.ActorHandleNotFoundError:  # made in an earlier session
                pass


def make_torch_scorer(path: str, backend: str, batch_size: int) -> RewardModelScorer | None:
    """The ``local`` and ``actor`` backends (None for another)."""
    if backend == "local":
        return TorchScorer(path, batch_size)
    if backend == "actor":
        return RayActorScorer(path, batch_size)
    return None


SCORER_FACTORIES.register(make_torch_scorer)

__all__ = ["RayActorScorer", "RewardScorer", "TorchModel", "TorchScorer", "make_torch_scorer"]
