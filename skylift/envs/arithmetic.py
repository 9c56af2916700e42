"""The ``arithmetic`` environments for synthetic tasks (`skylift.data.synthetic`).

- ``arithmetic``: single turn, same rule as ``gsm8k``.
- ``arithmetic_multiturn``: a wrong answer earns the feedback "Incorrect, try again." and another
  try, up to ``max_turns`` responses (default 2); the reward is 1.0 for a right answer on any turn
  and 0.0 otherwise, given on the step that ends the trajectory (intermediate steps get 0.0). It
  exists mainly so that a multi-turn agent loop can be tested end to end.
"""

from __future__ import annotations

from typing import Any

from skylift.envs.base import StepResult
from skylift.envs.final_answer import FinalAnswerEnv
from skylift.envs.registry import register_env

RETRY_FEEDBACK = "Incorrect, try again."


@register_env("arithmetic")
class ArithmeticEnv(FinalAnswerEnv):
    """Single-turn arithmetic grading by the last ``#### number``."""


@register_env("arithmetic_multiturn")
class ArithmeticMultiTurnEnv(FinalAnswerEnv):
    """Arithmetic with retries: feedback after a wrong answer, at most `max_turns` responses."""

    def __init__(self, max_turns: int = 2, feedback: str = RETRY_FEEDBACK, **config: Any) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        super().__init__(max_turns=max_turns, feedback=feedback, **config)
        self.max_turns = max_turns
        self.feedback = feedback

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        reward, metadata = self.score(action)
        metadata["turn"] = turn
        if metadata["correct"] or turn >= self.max_turns:
            self.done = True
            return StepResult(observations=[], reward=reward, done=True, metadata=metadata)
        return StepResult(
            observations=[{"role": "user", "content": self.feedback}],
            reward=0.0,
            done=False,
            metadata=metadata,
        )
