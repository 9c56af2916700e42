"""A SkyRL-Gym environment written as a SkyRL user writes one (used by test_skyrl_gym_envs.py):
a ``BaseTextEnv`` subclass constructed as ``Env(env_config, extras)``, registered by id."""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class MultiplyEnv(BaseTextEnv):
    """Reward 1 (+ env_config.bonus) when the answer ends the response; else ask again while turns last."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.answer = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = int(extras["max_turns"])
        self.bonus = float(env_config.get("bonus", 0.0)) if env_config is not None else 0.0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        correct = action.strip().endswith(self.answer)
        if correct or self.turns >= self.max_turns:
            reward = (1.0 + self.bonus) if correct else 0.0
            return BaseTextEnvStepOutput(
                observations=[],
                reward=reward,
                done=True,
                metadata={"correct": correct},
                postprocessed_action=None,
            )
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": "Wrong, try again."}],
            reward=0.0,
            done=False,
            metadata={},
            postprocessed_action=action.strip(),
        )

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}


skyrl_gym.register(id="skylift_test_multiply", entry_point="skyrl_gym_example_env:MultiplyEnv")


class FirstWordEnv(BaseTextEnv):
    """Rewrites each action to its first word (SkyRL's ``postprocessed_action``); reward 1 when
    that word is the answer; asks again while turns last."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.answer = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = int(extras["max_turns"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        word = (action.split() or [""])[0]
        done = word == self.answer or self.turns >= self.max_turns
        return BaseTextEnvStepOutput(
            observations=[] if done else [{"role": "user", "content": "Wrong, try again."}],
            reward=1.0 if word == self.answer else 0.0,
            done=done,
            metadata={},
            postprocessed_action=word,
        )
