"""``visgym``: the environment SkyRL's VisGym vision-language examples register
(``environment.env_class=visgym``): a gymnasium-style simulator whose every step is answered with a
new rendered image.

Rows (SkyRL's ``visgym/dataset.py``) are tickets: a placeholder ``prompt``, ``env_class`` visgym,
``visgym_env_id`` (e.g. ``maze_2d/easy``), optionally ``seed`` (eval rows) and ``visgym_kwargs``.
``init`` resets the simulator (with the row's seed) and replaces the prompt with one user message:
the simulator's ``get_prompt()`` and an action-format instruction as text, and its ``render()``
(an RGB array) as an image. Each ``step`` parses the action from the response, steps the simulator,
and unless the episode is over answers with its ``env_feedback`` and a new rendered image. The
episode ends when the simulator terminates or truncates, or after ``max_turns`` responses
(``generator.max_turns``); only the last step has a reward.

Two variants (SkyRL's entry point takes ``--env_variant``; here ``environment.env_configs.visgym.variant``):

- ``instruct`` (default; ``run_visgym_from_instruct.sh``): the response ends with
  ``<action>left|right|up|down|stop</action>`` (the last tag counts), mapped to the simulator's
  ``('move', 0..3)`` / ``('stop', 'stop')``; the simulator is made with ``relaxed=True``; reward: the
  simulator's at the end.
- ``sft`` (``run_visgym_from_sft.sh``): the response holds an action tuple, ``('move', 0)`` (an
  unquoted name is accepted); reward ``0.8 * task + 0.2 * format``, where format is the share of
  the episode's responses with non-empty ``<observation>``, ``<justification>`` and ``<action>``.

A response without a parsable action is a parse failure: no simulator step, the image again with
a hint (reward 0 unless it is the last turn). The simulator comes from
``gymnasium.make(visgym_env_id, **visgym_kwargs)``, which needs VisGym installed (it ships as its own
fork of the ``gymnasium`` package, not on PyPI); ``environment.env_configs.visgym.simulator`` may name
another maker, ``package.module:function`` called as ``function(env_id, **kwargs)``, returning an
object with gymnasium's ``reset``/``step``/``render``/``close`` and VisGym's ``get_prompt``.
Episode metrics: ``step_count``, ``parse_failures`` (and ``format_success_rate`` for ``sft``),
logged as ``environment/visgym/avg_<name>``.
"""

from __future__ import annotations

import ast
import base64
import importlib
import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skylift.compat.skyrl.gym import run_env_config, run_max_turns
from skylift.envs.base import Environment, EnvUsageError, Message, StepResult
from skylift.envs.registry import register_env

VARIANTS = ("instruct", "sft")
KEYWORDS = {"right": "('move', 0)", "up": "('move', 1)", "left": "('move', 2)", "down": "('move', 3)"}
KEYWORDS["stop"] = "('stop', 'stop')"
_ACTION_TAG = re.compile(r"<action>\s*(\w+)\s*</action>", re.IGNORECASE)
_TAGS = {
    tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ("observation", "justification", "action")
}
_TUPLE_OPEN = re.compile(r"""\(\s*(['"]?)(\w+)\1\s*,""")
TASK_WEIGHT, FORMAT_WEIGHT = 0.8, 0.2
_INSTRUCTIONS = {
    "instruct": "\n\nEnd your response with the action you choose as <action>ACTION</action>, where "
    "ACTION is one of: left, right, up, down, stop.",
    "sft": "\n\nAnswer with exactly one action, written as a Python tuple such as ('move', 0) or "
    "('stop', 'stop'), with no backticks or code block around it.",
}


def keyword_action(text: str) -> str | None:
    """The simulator action of the last ``<action>keyword</action>`` in `text`, else None."""
    tags = _ACTION_TAG.findall(text)
    return KEYWORDS.get(tags[-1].lower()) if tags else None


def _closing(text: str, start: int) -> int | None:
    """The index of the bracket closing the one at `start` (quotes skipped), else None."""
    depth, quote, i = 0, "", start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def tuple_action(text: str) -> str | None:
    """The first ``(name, argument)`` tuple in `text` that Python reads as a 2-tuple (an unquoted
    name gets quotes), as text; None when there is none."""
    for match in _TUPLE_OPEN.finditer(text):
        end = _closing(text, match.start())
        if end is None:
            continue
        candidate = text[match.start() : end + 1]
        if not match.group(1):  # unquoted name: quote it
            name_at = match.start(2) - match.start()
            candidate = f"{candidate[:name_at]}'{match.group(2)}'{candidate[name_at + len(match.group(2)) :]}"
        try:
            value = ast.literal_eval(candidate)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(value, tuple) and len(value) == 2:
            return candidate
    return None


def well_formatted(text: str) -> bool:
    """Whether `text` has non-empty ``<observation>``, ``<justification>`` and ``<action>``."""
    return all((m := tag.search(text)) is not None and m.group(1).strip() for tag in _TAGS.values())


def image_message(text: str, frame: Any) -> Message:
    """A user message with `text` and `frame` (an RGB array or PIL image) as a PNG ``data:`` URL."""
    from PIL import Image

    image = frame if isinstance(frame, Image.Image) else Image.fromarray(frame)
    out = io.BytesIO()
    image.convert("RGB").save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
    }


def _maker(name: str) -> Callable[..., Any]:
    if name in ("", "gymnasium"):
        try:
            gymnasium = importlib.import_module("gymnasium")
        except ImportError as exc:
            raise EnvUsageError(
                "visgym needs VisGym's simulators (gymnasium.make('maze_2d/easy')): VisGym ships as its "
                "own fork of the gymnasium package (github: anyscale/VisGym, not on PyPI); install it, or "
                "name another maker in environment.env_configs.visgym.simulator=package.module:function"
            ) from exc
        return gymnasium.make
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvUsageError(f"environment.env_configs.visgym.simulator={name!r}: {exc}") from exc


@register_env("visgym")
class VisGymEnv(Environment):
    """SkyRL's VisGym environment (see the module's docstring)."""

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        super().init(prompt, extras)
        settings = {**run_env_config("visgym"), **self.config}
        self.variant = str(settings.get("variant") or "instruct")
        if self.variant not in VARIANTS:
            raise EnvUsageError(f"environment.env_configs.visgym.variant={self.variant!r}: one of {VARIANTS}")
        env_id = self.extras.get("visgym_env_id")
        if not env_id:
            raise EnvUsageError(f"visgym: the row has no visgym_env_id (extras keys {sorted(self.extras)})")
        self.env_id = str(env_id)
        kwargs = dict(self.extras.get("visgym_kwargs") or {})
        if self.variant == "instruct":
            kwargs["relaxed"] = True
        self.max_turns = int(settings.get("max_turns") or self.extras.get("max_turns") or run_max_turns())
        self.sim = _maker(str(settings.get("simulator") or ""))(self.env_id, **kwargs)
        seed = self.extras.get("seed")
        self.sim.reset(seed=None if seed is None else int(seed))
        self.parse_failures = self.format_successes = 0
        return [image_message(str(self.sim.get_prompt()) + _INSTRUCTIONS[self.variant], self.sim.render())]

    def _reward(self, task: float) -> float:
        if self.variant == "instruct":
            return task
        return TASK_WEIGHT * task + FORMAT_WEIGHT * self.format_successes / self.turns

    def _metrics(self) -> dict[str, float]:
        out = {"step_count": float(self.turns), "parse_failures": float(self.parse_failures)}
        if self.variant == "sft":
            out["format_successes"] = float(self.format_successes)
            out["format_success_rate"] = self.format_successes / self.turns
        return out

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        if self.variant == "sft" and well_formatted(action):
            self.format_successes += 1
        parsed = keyword_action(action) if self.variant == "instruct" else tuple_action(action)
        metadata: dict[str, Any] = {"visgym_env_id": self.env_id, "extracted_action": parsed or ""}
        if parsed is None:
            self.parse_failures += 1
            done, task, feedback = turn >= self.max_turns, 0.0, self._parse_hint()
            metadata["env_feedback"] = "parse_failure"
        else:
            _, task, terminated, truncated, info = self.sim.step(parsed)
            done = bool(terminated or truncated) or turn >= self.max_turns
            feedback = (
                str((info or {}).get("env_feedback") or "") or "Action executed. Here is the current state:"
            )
            metadata.update(env_feedback=feedback, terminated=bool(terminated), truncated=bool(truncated))
        self.done = done
        metadata["env_metrics"] = self._metrics()
        observations = [] if done else [image_message(feedback, self.sim.render())]
        reward = self._reward(float(task)) if done else 0.0
        return StepResult(observations=observations, reward=reward, done=done, metadata=metadata)

    def _parse_hint(self) -> str:
        if self.variant == "instruct":
            return (
                "No action found. End your response with <action>ACTION</action>, ACTION one of: "
                + ", ".join(sorted(KEYWORDS))
            )
        return "No action tuple found. Answer with exactly one action as a Python tuple, e.g. ('move', 0)."

    def close(self) -> None:
        sim = getattr(self, "sim", None)
        if sim is not None and hasattr(sim, "close"):
            sim.close()
        super().close()

    @staticmethod
    def aggregate_metrics(episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """``avg_<name>`` of each numeric episode metric (SkyRL's names)."""
        keys = ("step_count", "parse_failures", "format_successes", "format_success_rate")
        out = {}
        for key in keys:
            values = [float(e[key]) for e in episodes if key in e]
            if values:
                out[f"avg_{key}"] = sum(values) / len(values)
        return out
