"""``reward_model``: an environment whose reward is a trained reward model's score of the rollout.

The run names the model and where it runs through the environment's keyword arguments::

    skylift train environment.env_class=reward_model environment.env_kwargs.path=RM_DIR \\
        [environment.env_kwargs.backend=actor|local|vllm] [environment.env_kwargs.batch_size=16]

``path`` is a reward model directory (``skylift sft objective=reward``'s export, or any
``*ForSequenceClassification`` with one label). Each rollout is the row's prompt and the policy's
response as one assistant message, rendered by the reward model's chat template as its training
rendered pairs, and scored by a scorer (`skylift.inference.reward_scoring`):

- ``actor`` (default): a Ray actor holding the model in torch (Ray is started if the run has none);
- ``local``: the model in torch in the generator's process;
- ``vllm``: a vLLM pooling engine (``runner="pooling"``, raw scores: no activation).

A group's rollouts are scored together in `finish_group` (one call per group; the reward is added
there, and logged as ``env/group/reward_model_score``); `step` ends the single-turn episode with
reward 0. Scorers are made once per run and (path, backend) and shared by every environment (a run's
start releases an earlier run's);
``timeout_s`` bounds each wait for them (the first one loads the model).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from skylift.envs.base import Environment, StepResult
from skylift.envs.registry import register_env, register_run_configurer
from skylift.utils.hooks import Hook

BACKENDS = ("actor", "local", "vllm")
KWARGS = ("path", "backend", "batch_size", "timeout_s")


class RewardModelScorer(Protocol):
    """Conversations (lists of messages) -> one reward each."""

    def score_conversations(self, conversations: Sequence[list[dict[str, Any]]]) -> list[float]: ...

    def close(self) -> None: ...


#: factory(path, backend, batch_size) -> a scorer, or None when `backend` is not its own
SCORER_FACTORIES: Hook[Callable[[str, str, int], RewardModelScorer | None]] = Hook(
    "reward model scorer", ("skylift.inference.reward_scoring", "skylift.inference.reward_pooling")
)
_SCORERS: dict[tuple[str, str], RewardModelScorer] = {}
_LOCK = threading.Lock()


def scorer_for(path: str, backend: str, batch_size: int = 16) -> RewardModelScorer:
    """The process's scorer of `path` on `backend`, made on the first call."""
    if backend not in BACKENDS:
        raise ValueError(f"reward model backend {backend!r} is not one of {', '.join(BACKENDS)}")
    with _LOCK:
        scorer = _SCORERS.get((path, backend))
        if scorer is None:
            for factory in SCORER_FACTORIES.items():
                scorer = factory(path, backend, batch_size)
                if scorer is not None:
                    break
            if scorer is None:
                raise ValueError(f"no reward model scorer is registered for backend {backend!r}")
            _SCORERS[(path, backend)] = scorer
        return scorer


def close_scorers() -> None:
    """Release every scorer this process made."""
    with _LOCK:
        for scorer in _SCORERS.values():
            scorer.close()
        _SCORERS.clear()


@register_run_configurer
def _fresh_scorers(environment: Any, max_turns: int) -> None:
    """A run makes its own scorers: an earlier run's (in this process) are released first (a Ray
    actor of an earlier Ray session would not answer)."""
    close_scorers()


@register_env("reward_model")
class RewardModelEnv(Environment):
    """See the module docstring. Keyword arguments: ``path`` (required), ``backend``,
    ``batch_size`` (rows a forward pass), ``timeout_s`` (the longest wait for a scorer)."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        unknown = sorted(set(config) - set(KWARGS))
        if unknown:
            raise ValueError(
                f"reward_model: unknown environment.env_kwargs {unknown}; accepted: {', '.join(KWARGS)}"
            )
        if not config.get("path"):
            raise ValueError("reward_model: set environment.env_kwargs.path to a reward model directory")
        self.path = str(config["path"])
        self.backend = str(config.get("backend", "actor"))
        if self.backend not in BACKENDS:
            raise ValueError(f"reward_model: backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        self.batch_size = int(config.get("batch_size", 16))
        self.timeout_s = float(config.get("timeout_s", 600.0))
        self.response = ""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        self.response = action
        return StepResult(observations=[], reward=0.0, done=True)

    async def finish_group(
        self, group: list[Environment], trajectories: list[Any]
    ) -> list[tuple[float, dict[str, float]]]:
        envs = [e for e in group if isinstance(e, RewardModelEnv)]
        if len(envs) != len(group):
            raise ValueError("reward_model: a group mixes reward_model and other environments")
        conversations = [[*e.prompt, {"role": "assistant", "content": e.response}] for e in envs]
        try:  # the first call loads the model (a vLLM engine starts in it): within the same bound
            scorer = await asyncio.wait_for(
                asyncio.to_thread(scorer_for, self.path, self.backend, self.batch_size), self.timeout_s
            )
            scores = await asyncio.wait_for(
                asyncio.to_thread(scorer.score_conversations, conversations), self.timeout_s
            )
        except TimeoutError as exc:
            raise TimeoutError(
                f"reward_model {self.path} ({self.backend}): no scores within timeout_s={self.timeout_s:.0f} s"
            ) from exc
        return [(float(s), {"reward_model_score": float(s)}) for s in scores]


__all__ = [
    "BACKENDS",
    "SCORER_FACTORIES",
    "RewardModelEnv",
    "RewardModelScorer",
    "close_scorers",
    "scorer_for",
]
