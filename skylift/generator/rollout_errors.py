"""The errors of a rollout that come from the user's input, named by prompt.

A rollout runs the user's data and code: the dataset row (its messages as the chat template renders
them, its images, its length), the environment class (its constructor, ``init``, ``step``,
``close``, the group hooks and what they return) and the engine's limits on one request (a 4xx
from a server, a prompt past vLLM's ``max_model_len``). A failure there reaches the trainer as
its own type, marked with the prompt's uid (and the environment's method when one raised it):
`rollout_input` reads the mark as one line, which `skylift.rl.loop` stops the run with, saving the
last completed step. Anything else that fails in a rollout (an engine that is gone, a bug of
skylift's) goes through unmarked and keeps its traceback.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from skylift.generator.chat import ChatTemplateError
from skylift.generator.vision import VisionError
from skylift.utils.engine_errors import EngineError, EngineRequestError
from skylift.utils.messages import one_line


class EnvironmentFailed(RuntimeError):
    """An environment's method raised, or returned what a rollout cannot use (e.g. a reward that
    is not a number); the message names the class and the method."""


class HistoryRewriteError(ValueError):
    """A token-level environment's next context does not extend the previous one."""


class PromptTooLongError(ValueError):
    """A prompt (as the chat template renders it) is longer than `generator.max_prompt_length`."""


def check_prompt_length(uid: str, ids: list[int], limit: int) -> None:
    """`PromptTooLongError` when prompt `uid`'s first context (`ids`, as the chat template or a
    token-level environment renders it) is longer than `generator.max_prompt_length` (`limit`)."""
    if len(ids) > limit:
        raise PromptTooLongError(
            f"prompt {uid} has {len(ids)} tokens, more than generator.max_prompt_length={limit}"
        )


#: the causes that are the user's input (anything else in a rollout is not)
USER_INPUT: tuple[type[BaseException], ...] = (
    EngineRequestError,
    EnvironmentFailed,
    PromptTooLongError,
    ChatTemplateError,
    HistoryRewriteError,
    VisionError,
)


#: the attributes a failure on the user's input carries (set by `rollout_of` and `env_raised`)
_UID, _ENV = "skylift_prompt_uid", "skylift_env_method"


@contextmanager
def rollout_of(uid: str, also: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Mark the failures on the user's input inside (`USER_INPUT`, the types in `also`: a wing's
    own, e.g. a verifiers episode that failed, or raised by an environment's method) as prompt
    `uid`'s and let them go on, their type unchanged (`rollout_input` reads it)."""
    try:
        yield
    except Exception as exc:
        mine = isinstance(exc, USER_INPUT + also) or hasattr(exc, _ENV)
        if mine and not hasattr(exc, _UID):
            with suppress(AttributeError):  # an exception without a __dict__ stays unmarked
                setattr(exc, _UID, uid)
        raise


def env_raised(exc: Exception, where: str) -> None:
    """Mark `exc` as raised by the environment's method `where` ("Class.method"); not an engine's
    error (the environment's own LLM calls: an engine that is gone stops the run as such), nor one
    marked already."""
    if not isinstance(exc, EngineError | EnvironmentFailed) and not hasattr(exc, _ENV):
        with suppress(AttributeError):
            setattr(exc, _ENV, where)


def rollout_input(exc: BaseException) -> str | None:
    """The one line that says what failed in a rollout on the user's input and for which prompt,
    when `exc` is such a failure (marked by `rollout_of`); None when it is not (e.g. a bug)."""
    uid = getattr(exc, _UID, None)
    if uid is None:
        return None
    text = one_line(str(exc)) or "(no message)"
    if (method := getattr(exc, _ENV, None)) is not None:
        text = f"{method} raised {type(exc).__name__}: {text}"
    elif isinstance(exc, EngineRequestError):
        text = f"the engine refused its request: {text}"
    return text if f"prompt {uid}" in text else f"prompt {uid}: {text}"


def number(value: Any, what: str, finite: bool = True) -> float:
    """`value` as a float (a finite one where `finite`); `EnvironmentFailed` saying `what`
    returned it otherwise."""
    if not isinstance(value, str | bytes):
        try:
            out = float(value)
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(out) or not finite:
                return out
    shown = repr(value)
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    kind = "a finite number" if finite else "a number"
    raise EnvironmentFailed(f"{what} {shown} ({type(value).__name__}), not {kind}")


def checked_step(env: Any, method: str, result: Any) -> Any:
    """`result` of `env.<method>` (``step``/``step_tokens``) when its reward is a finite number
    and its metrics numbers (a NaN metric is logged as such, not a reason to stop a run);
    `EnvironmentFailed` naming what is wrong otherwise."""
    where = f"{type(env).__name__}.{method}"
    if not hasattr(result, "reward") or not hasattr(result, "done"):
        raise EnvironmentFailed(f"{where} returned {type(result).__name__}, not a StepResult")
    number(result.reward, f"{where} returned the reward")
    for name, value in (getattr(result, "metrics", None) or {}).items():
        number(value, f"{where} returned the metric {name!r}:", finite=False)
    return result
