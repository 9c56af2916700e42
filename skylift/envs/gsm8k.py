"""The ``gsm8k`` environment: single-turn, reward 1.0 for the right ``#### number``, else 0.0."""

from __future__ import annotations

from skylift.envs.final_answer import FinalAnswerEnv
from skylift.envs.registry import register_env


@register_env("gsm8k")
class GSM8KEnv(FinalAnswerEnv):
    """GSM8K grading: the last ``#### number`` of the response must equal ``reward_spec.ground_truth``
    (``,`` and ``$`` removed, compared as decimals; see `skylift.envs.rewards`)."""
