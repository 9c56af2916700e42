"""``geometry3k``: the environment SkyRL's Geometry-3K vision-language example registers
(``environment.env_class=geometry3k``), so its command lines run in skylift unchanged.

Rows (SkyRL's ``geometry_3k_dataset.py`` writes them): ``prompt`` is one user message whose content
is the diagram as ``image_url`` parts (``data:`` URLs) then the question as a ``text`` part;
``reward_spec.ground_truth`` is the answer (LaTeX, e.g. ``3\\sqrt{3}``); ``env_class`` geometry3k.

The policy may check an answer up to ``max_turns`` times (``generator.max_turns``, as SkyRL's
generator passes it; 3 in SkyRL's scripts) with a ``calc_score`` tool call,
``<tool_call>{"name": "calc_score", "arguments": {"answer": "..."}}</tool_call>`` (also
``{"function": {"name": ..., "arguments": ...}}``, arguments as a JSON string too; the last call in
a response counts):

- a right answer ends the episode with reward 1.0;
- a wrong one gets feedback as a user message and reward 0.0 (the turn before the last says it is
  the last chance); on the last turn it ends the episode with 0.0;
- a call to another tool, or without an answer, gets feedback saying how to call (ends with 0.0
  on the last turn);
- a response without a tool call ends the episode: its last ``\\boxed{}``, else its last non-empty
  line (512 characters at most), is graded, 1.0 or 0.0.

Answers are graded by `skylift.compat.skyrl.math_answers.same_answer`. Episode metrics: ``turns``
and ``acc``, logged as ``environment/geometry3k/avg_turns`` and ``avg_acc``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from skylift.compat.skyrl.gym import run_max_turns
from skylift.compat.skyrl.math_answers import last_boxed, same_answer
from skylift.envs.base import Environment, Message, StepResult
from skylift.envs.final_answer import ground_truth_from
from skylift.envs.registry import register_env

TOOL = "calc_score"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_HOW = f'<tool_call>{{"name": "{TOOL}", "arguments": {{"answer": "<your answer>"}}}}</tool_call>'


def parse_tool_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """The (name, arguments) of the last well-formed tool call in `text`, else None."""
    for match in reversed(list(_CALL.finditer(text))):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            return None  # SkyRL's rule: the last call decides, a broken one is no call
        if not isinstance(payload, dict):
            return None
        function = payload.get("function") if isinstance(payload.get("function"), dict) else {}
        name = payload.get("name") or function.get("name")
        arguments = payload.get("arguments") or function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not name or not isinstance(arguments, dict):
            return None
        return str(name), arguments
    return None


def answer_in_text(text: str) -> str | None:
    """A response's answer when it calls no tool: its last ``\\boxed{}``, else its last non-empty line."""
    boxed = last_boxed(text)
    if boxed and boxed.strip():
        return boxed.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:512] if lines else None


def score(answer: str, ground_truth: str) -> float:
    """1.0 when `answer` (boxed or bare) states `ground_truth`, else 0.0."""
    return 1.0 if same_answer(answer.strip(), ground_truth) else 0.0


@register_env("geometry3k")
class Geometry3kEnv(Environment):
    """SkyRL's Geometry-3K environment: answers checked with a ``calc_score`` tool, up to
    ``max_turns`` responses (see the module's docstring)."""

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        out = super().init(prompt, extras)
        self.ground_truth = ground_truth_from(self.extras, self.config)
        self.max_turns = int(self.config.get("max_turns") or self.extras.get("max_turns") or run_max_turns())
        self.correct = False
        return out

    def _result(self, reward: float, done: bool, feedback: str, **metadata: Any) -> StepResult:
        self.done = done
        observations = [] if done else [{"role": "user", "content": feedback}]
        metadata = {"ground_truth": self.ground_truth, **metadata}
        metadata["env_metrics"] = {"turns": self.turns, "acc": 1.0 if self.correct else 0.0}
        return StepResult(observations=observations, reward=reward, done=done, metadata=metadata)

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        last = turn >= self.max_turns
        call = parse_tool_call(action)
        if call is None:
            answer = answer_in_text(action)
            if answer is not None:
                self.correct = score(answer, self.ground_truth) == 1.0
            return self._result(1.0 if self.correct else 0.0, True, "", tool_call=False, answer=answer)
        name, arguments = call
        if name != TOOL:
            feedback = f"There is no tool {name!r}. Check an answer with {_HOW}."
            return self._result(0.0, last, feedback, tool_call=True, unsupported_tool=name)
        answer = str(arguments.get("answer") or "").strip()
        if not answer:
            feedback = f"The {TOOL} call has no answer. Call it as {_HOW}."
            return self._result(0.0, last, feedback, tool_call=True, answer_missing=True)
        value = score(answer, self.ground_truth)
        self.correct = value == 1.0
        done = self.correct or last
        if self.correct:
            feedback = ""
        elif turn == self.max_turns - 1:
            feedback = (
                f"{TOOL}: 0.0. The answer {answer!r} is wrong. This is your last turn: do not call "
                "the tool again; think it over another way and give your final answer as \\boxed{...}."
            )
        else:
            feedback = f"{TOOL}: 0.0. The answer {answer!r} is wrong. Try another way of solving it."
        return self._result(
            value if done else 0.0, done, feedback, tool_call=True, answer=answer, score=value
        )

    @staticmethod
    def aggregate_metrics(episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Mean turns and accuracy of a batch's episodes (SkyRL's names)."""
        if not episodes:
            return {}
        n = len(episodes)
        return {
            "avg_turns": sum(float(e.get("turns", 0)) for e in episodes) / n,
            "avg_acc": sum(float(e.get("acc", 0)) for e in episodes) / n,
        }
