"""OpenEnv environments (``openenv-core``) as skylift environments, through their WebSocket client.

Select it with ``env_class: openenv`` and point it at a running OpenEnv server
(``openenv.core.env_server.create_app``, ``openenv serve``, a Docker image or a Space) with
``environment.env_kwargs``:

- ``base_url`` (required): the server, e.g. ``http://127.0.0.1:8000``;
- ``action_field`` (``"message"``): the action field that carries the policy's response text
  (the rest of the action is ``action_defaults``, a mapping, default empty);
- ``observation_field`` (``"message"``): the observation field shown to the policy as the next
  user message; its value after ``reset`` is appended to the row's prompt when
  ``prompt_from_reset`` is true (default: only when the row's prompt is empty);
- ``connect_timeout_s`` (10), ``message_timeout_s`` (60): the client's timeouts.

Each trajectory opens one session (``reset`` with the row's ``extra_info["openenv_reset"]``, e.g.
a seed or a task id), steps it once per turn with the response text, and closes it. A step's
``reward`` (None counts 0) is the turn's reward and ``done`` ends the trajectory; the whole
observation is in the step's metadata. Server errors and timeouts raise with the server's message.
"""

from __future__ import annotations

from typing import Any

from skylift.envs.base import Environment, EnvUsageError, Message, StepResult
from skylift.envs.registry import register_env

_OPTIONS = {
    "base_url": None,
    "action_field": "message",
    "action_defaults": {},
    "observation_field": "message",
    "prompt_from_reset": None,
    "connect_timeout_s": 10.0,
    "message_timeout_s": 60.0,
}


@register_env("openenv")
class OpenEnvEnv(Environment):
    """One OpenEnv session per trajectory (see the module docstring for the options)."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        unknown = sorted(set(config) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"openenv: unknown option(s) {unknown}; known: {sorted(_OPTIONS)}")
        self.options = {**_OPTIONS, **config}
        if not self.options["base_url"]:
            raise ValueError("openenv: set environment.env_kwargs.base_url to the OpenEnv server's URL")
        if not isinstance(self.options["action_defaults"], dict):
            raise ValueError("openenv: action_defaults must be a mapping")
        self.client: Any = None

    async def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        from openenv.core.generic_client import GenericEnvClient

        messages = super().init(prompt, extras)
        reset = (self.extras.get("extra_info") or {}).get("openenv_reset") or {}
        if not isinstance(reset, dict):
            raise ValueError(f"openenv: extra_info.openenv_reset must be a mapping, got {reset!r}")
        self.client = GenericEnvClient(
            base_url=str(self.options["base_url"]),
            connect_timeout_s=float(self.options["connect_timeout_s"]),
            message_timeout_s=float(self.options["message_timeout_s"]),
        )
        result = await self.client.reset(**reset)
        from_reset = self.options["prompt_from_reset"]
        if from_reset is None:
            from_reset = not messages
        text = self._text(result.observation)
        if from_reset and text:
            messages.append({"role": "user", "content": text})
        if not messages:
            raise ValueError("openenv: the row has no prompt and the reset observation has no text")
        return messages

    async def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.client is None:
            raise EnvUsageError("openenv: step() called before init()")
        payload = {**self.options["action_defaults"], str(self.options["action_field"]): action}
        result = await self.client.step(payload)
        done = bool(result.done)
        self.done = done
        text = self._text(result.observation)
        return StepResult(
            observations=[] if done or not text else [{"role": "user", "content": text}],
            reward=float(result.reward or 0.0),
            done=done,
            metadata={"observation": dict(result.observation or {})},
        )

    async def close(self) -> None:  # type: ignore[override]
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        super().close()

    def _text(self, observation: Any) -> str:
        value = (observation or {}).get(str(self.options["observation_field"]))
        return "" if value is None else str(value)
