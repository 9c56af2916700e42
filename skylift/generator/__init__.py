"""Rollout generation: prompts -> engine -> environment -> trajectories with exact token ids."""

from skylift.generator.generator import Generator, GeneratorSettings
from skylift.generator.trajectory import Trajectory

__all__ = ["Generator", "GeneratorSettings", "Trajectory"]
