"""`FinalAnswerEnv`: single-turn scoring of a ``#### number`` answer against a ground truth."""

from __future__ import annotations

from typing import Any

from skylift.envs.base import Environment, EnvUsageError, Message, StepResult
from skylift.envs.rewards import answers_equal, parse_final_answer


def ground_truth_from(extras: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """The reference answer in a dataset row's extras: ``reward_spec.ground_truth`` (`skylift.data.schema`),
    else a top-level ``ground_truth``; then the same keys in the env's `config`."""
    for source in (extras, config or {}):
        spec = source.get("reward_spec")
        if isinstance(spec, dict) and spec.get("ground_truth") is not None:
            return str(spec["ground_truth"])
        if source.get("ground_truth") is not None:
            return str(source["ground_truth"])
    raise EnvUsageError(
        "no ground truth: init(prompt, extras) needs extras['reward_spec']['ground_truth'] "
        f"(got extras keys {sorted(extras)})"
    )


class FinalAnswerEnv(Environment):
    """Reward 1.0 when the response's last ``#### number`` equals the ground truth, else 0.0; one turn."""

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        out = super().init(prompt, extras)
        self.ground_truth = ground_truth_from(self.extras, self.config)
        return out

    def score(self, action: str) -> tuple[float, dict[str, Any]]:
        """The reward of `action` and the metadata that explains it."""
        parsed = parse_final_answer(action)
        correct = answers_equal(parsed.answer, self.ground_truth)
        metadata = {
            "found_marker": parsed.found_marker,
            "parsed_answer": parsed.answer,
            "ground_truth": self.ground_truth,
            "correct": correct,
        }
        return (1.0 if correct else 0.0), metadata

    def step(self, action: str) -> StepResult:
        self._begin_step()
        reward, metadata = self.score(action)
        self.done = True
        return StepResult(observations=[], reward=reward, done=True, metadata=metadata)
