"""Rollout generation: prompts -> engine -> environment -> trajectories with exact token ids."""

from skylift.generator.generator import Generator
from skylift.generator.metrics import rollout_metrics, turn_reward_tensor
from skylift.generator.settings import GeneratorSettings
from skylift.generator.trajectory import Trajectory

__all__ = ["Generator", "GeneratorSettings", "Trajectory", "rollout_metrics", "turn_reward_tensor"]
