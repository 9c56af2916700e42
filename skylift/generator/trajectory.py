"""A finished rollout: exactly the tokens the engine sampled, and what the environment said."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One sampled response (possibly several turns) to one prompt.

    `response_ids` holds every token after the prompt: the policy's sampled tokens and, in
    multi-turn rollouts, the environment's observation tokens in between, which have
    `loss_mask` 0 and `rollout_logprobs` 0.
    """

    uid: str  # the prompt's id: trajectories sharing it form one GRPO group
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    stop_reason: str
    data_source: str = ""
    num_turns: int = 1
    policy_version: int = 0  # the oldest policy version among its sampled tokens
    #: per response token, the policy version that sampled it (observation tokens: the version
    #: of the turn before); None when the engine does not label tokens (then all `policy_version`)
    token_versions: list[int] | None = None
    env_metadata: dict[str, Any] = field(default_factory=dict)
    response_text: str = ""
    #: multi-turn: (response index of the turn's last sampled token, the step's reward) per turn;
    #: `reward` is their sum. Empty: the whole reward belongs to the last token.
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    #: the environment's step metrics summed over the turns (e.g. ``tool_calls``)
    metrics: dict[str, float] = field(default_factory=dict)
    #: step-wise trajectories (`generator.step_wise_trajectories`): each turn is its own sample,
    #: with the id of the rollout it belongs to (None: the whole rollout is this one sample), its
    #: `reward` the rollout's; the advantage of the rollout's last step is every step's
    trajectory_id: str | None = None
    last_step: bool = True
    #: the environment that scored it (the row's ``env_class``, else the default one)
    env_class: str = ""
    #: the rollout's wall-clock seconds (`skylift.generator.timing`): ``completion``, ``llm`` and
    #: ``env``; on a step-wise rollout's last step only; empty when not recorded. Not compared
    timing: dict[str, float] = field(default_factory=dict, compare=False)
    #: a vision-language model's image inputs of this sample (``pixel_values``, ``image_grid_thw``:
    #: `skylift.generator.vision`), which the trainer's forward takes with its ids; None: text only
    vision_inputs: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    #: routing replay (`generator.enable_return_routed_experts`): the experts the engine routed each
    #: token of prompt + response to, [tokens, layers, top_k] integers, -1 for a token it did not
    #: route (the last sampled token, observations after the last turn); None: not asked
    routed_experts: Any | None = field(default=None, compare=False, repr=False)
    #: while the rollout runs: its images (one image token each in its ids), until `vision_inputs`
    images: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.loss_mask))
