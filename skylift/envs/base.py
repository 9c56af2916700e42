"""The environment interface: what the generator talks to while it rolls out a trajectory.

One `Environment` instance scores one trajectory. The generator calls, in order:

1. ``init(prompt, extras)`` with the dataset row's chat prompt and its extras (``reward_spec``,
   ``extra_info``, ``data_source``); it returns the prompt to send to the policy (possibly changed);
2. ``step(action)`` with the policy's response text, which returns a `StepResult`; while
   ``done`` is False, ``observations`` are the new messages (e.g. a user turn) to append after the
   assistant's response before generating again (multi-turn);
3. ``close()`` once the trajectory is finished.

``init``, ``step`` and ``close`` may be ``async def``: the generator awaits them on its event loop
(use this for environments that wait on I/O, e.g. a judge model through ``self.llm``). Plain
methods run in the generator's thread pool when ``environment.max_env_workers > 0``, else inline.

Before ``init`` the generator hands the environment what it may use while it runs:
``self.llm`` (an `skylift.envs.llm.LLMClient`: the policy's own engines or a judge URL) and
``self.tool_runner`` (a `skylift.envs.tools.ToolRunner` with the run's timeout and concurrency
limit). ``tool_schemas()`` returns the JSON schemas of the tools the policy may call; the generator
passes them to the chat template as ``tools=`` (see `skylift.envs.tools.ToolEnvironment`).
``self.tokenizer`` is the policy's tokenizer (token-level environments: `skylift.envs.token_env`).

Groups: the generator makes the `n` environments of one prompt's samples together and calls the
first one's ``setup_group(group, prompt, extras)`` before any ``init``, and its
``finish_group(group, trajectories)`` once the group's trajectories are done; what it returns, one
reward or ``(reward, metrics)`` per trajectory, is added to the trajectories' rewards (rewards that
compare the group's samples, as tinker-cookbook's ``EnvGroupBuilder.compute_group_rewards``; the
metrics are logged as ``env/group/<name>``). Both may be ``async def``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass
class StepResult:
    """The outcome of one `Environment.step`.

    observations: messages to append to the conversation before the next turn (empty when done).
    reward: the reward for this step (single-turn envs: the trajectory's reward).
    done: whether the trajectory is finished.
    metadata: free-form details for logging (e.g. what answer was parsed).
    metrics: numbers to log (e.g. ``tool_calls``); the generator sums them over a trajectory's
    steps and the trainer logs their means over the batch as ``env/<name>``.
    """

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class EnvUsageError(RuntimeError):
    """An environment was used wrongly (stepped after done, or initialised without what it needs)."""


class Environment(ABC):
    """Base class of every environment; subclasses implement `step` and may override `init`/`close`.

    Constructor keyword arguments are the environment's configuration (``make_env(name, **config)``);
    the base class keeps them in ``self.config``.
    """

    def __init__(self, **config: Any) -> None:
        self.config: dict[str, Any] = dict(config)
        self.prompt: list[Message] = []
        self.extras: dict[str, Any] = {}
        self.turns = 0
        self.done = False
        self.llm: Any = None  # an LLMClient, set by the generator before init
        self.tool_runner: Any = None  # a ToolRunner, set by the generator before init
        self.tokenizer: Any = None  # the policy's tokenizer, set by the generator before init

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """JSON schemas of the tools the policy may call (for the chat template), or None."""
        return None

    def setup_group(
        self, group: list[Environment], prompt: list[Message], extras: dict[str, Any]
    ) -> None | Awaitable[None]:
        """Called on the first environment of a prompt's group (`group`, this one included) before
        any of them is initialised; nothing here."""
        return None

    def finish_group(self, group: list[Environment], trajectories: list[Any]) -> Any:
        """Called on the first environment of a group with the group's finished trajectories (in
        `group`'s order); may return one reward (or ``(reward, metrics)``) per trajectory to add to
        it (None here)."""
        return None

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Start a trajectory; return the prompt to send to the policy (a copy of `prompt` here)."""
        self.prompt = [dict(m) for m in prompt]
        self.extras = dict(extras or {})
        self.turns = 0
        self.done = False
        return [dict(m) for m in self.prompt]

    @abstractmethod
    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Consume the policy's response `action` and return the reward and what comes next
        (may be ``async def``)."""

    def close(self) -> None:
        """Release whatever the environment holds (nothing here); ends the trajectory."""
        self.done = True

    def _begin_step(self) -> int:
        """Count a step and refuse one after the trajectory ended; returns the 1-based turn."""
        if self.done:
            raise EnvUsageError(f"{type(self).__name__}.step() called after the trajectory was done")
        self.turns += 1
        return self.turns

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
