"""A small OpenEnv environment and its server on 127.0.0.1, for the OpenEnv adapter's tests.

``GuessGame``: ``reset(target=...)`` picks the number to guess (default 7) and greets; each
``step`` takes a ``GuessAction`` (``message``: the guess as text, ``hint``: whether to say higher or
lower); a right guess scores 1 and ends, a wrong one scores 0 and hints; the third guess ends.
`serve` runs the ``openenv-core`` FastAPI app under uvicorn in a thread (``max_concurrent_envs``
sessions) and returns its URL and a stop function.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str
    hint: bool = True


class GuessObservation(Observation):
    message: str = ""


class GuessGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target = 7
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, target: int = 7, **_: Any
    ) -> GuessObservation:
        self.target = int(target)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess my number between 1 and 9.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **_: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        found = re.findall(r"-?\d+", action.message)
        guess = int(found[-1]) if found else None
        if guess == self.target:
            return GuessObservation(message="Right.", reward=1.0, done=True)
        hint = "" if guess is None or not action.hint else (" Higher." if guess < self.target else " Lower.")
        done = self._state.step_count >= 3
        return GuessObservation(message=f"Wrong.{hint}", reward=0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


def serve(max_concurrent_envs: int = 16) -> tuple[str, Callable[[], None]]:
    """The game's OpenEnv server on an ephemeral port of 127.0.0.1: (its URL, a stop function).
    Logs only critical errors: openenv-core's WebSocket handler logs a traceback whenever a client
    closes its session first (as `EnvClient.close` does), which says nothing wrong."""
    import uvicorn

    app = create_fastapi_app(
        GuessGame, GuessAction, GuessObservation, max_concurrent_envs=max_concurrent_envs
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True, name="openenv-game")
    thread.start()
    deadline = time.monotonic() + 30.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the OpenEnv game server did not start within 30 s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10.0)

    return f"http://127.0.0.1:{port}", stop
