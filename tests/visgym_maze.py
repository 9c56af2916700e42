"""A 3x3 maze with VisGym's interface, for the ``visgym`` environment's tests (VisGym itself ships
as a fork of the gymnasium package that is not on PyPI, so it cannot be installed here).

`make_maze(env_id, **kwargs)` is what ``environment.env_configs.visgym.simulator`` names. The agent
starts at the top-left cell, the goal is the bottom-right one; ``step("('move', d)")`` moves it
(0 right, 1 up, 2 left, 3 down; walls stop it), ``('stop', 'stop')`` ends the episode; reaching the
goal terminates with reward 1. ``render()`` draws the grid as an RGB array (agent red, goal green).
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np

CELL = 28
MOVES = {0: (0, 1), 1: (-1, 0), 2: (0, -1), 3: (1, 0)}


class Maze:
    def __init__(self, env_id: str, relaxed: bool = False, size: int = 3) -> None:
        self.env_id, self.relaxed, self.size = env_id, relaxed, size
        self.agent = (0, 0)
        self.closed = False
        self.seeds: list[int | None] = []

    def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
        self.seeds.append(seed)
        self.agent = (0, 0)
        return self.render(), {}

    def get_prompt(self) -> str:
        return "Move the red square to the green one."

    def render(self) -> np.ndarray:
        frame = np.full((self.size * CELL, self.size * CELL, 3), 255, dtype=np.uint8)
        for (r, c), colour in ((self.agent, (250, 0, 0)), ((self.size - 1,) * 2, (0, 200, 0))):
            frame[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL] = colour
        return frame

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        name, arg = ast.literal_eval(action)
        if name == "stop":
            return self.render(), 0.0, True, False, {"env_feedback": "stopped"}
        dr, dc = MOVES[int(arg)]
        r, c = self.agent[0] + dr, self.agent[1] + dc
        moved = 0 <= r < self.size and 0 <= c < self.size
        if moved:
            self.agent = (r, c)
        goal = self.agent == (self.size - 1, self.size - 1)
        feedback = "" if moved else "You hit a wall."
        return self.render(), float(goal), goal, False, {"env_feedback": feedback}

    def close(self) -> None:
        self.closed = True


def make_maze(env_id: str, **kwargs: Any) -> Maze:
    return Maze(env_id, **kwargs)
