"""What a multi-turn rollout records turn by turn and how it ends, shared by the text
(`multi_turn.py`) and token-level (`token_turns.py`) turn loops: each turn's sampled ids (trained)
and the environment's answer, untrained ids between turns, then the reward rules of a non-`stop`
ending and either one `Trajectory` or its steps (`generator.step_wise_trajectories`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from skylift.generator.routed import overlay, routed_tokens
from skylift.generator.settings import TURN_SEED_STRIDE
from skylift.generator.step_wise import Step, TurnRecord, step_trajectories, steps_of_turns
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import Completion, SamplingParams


@dataclass(frozen=True)
class RolloutTask:
    """One rollout to run: its prompt row, its environment and the row's extras for it, the sampling
    parameters, the policy version that samples and the rollout's seed (None: unseeded)."""

    row: Any
    env: Any
    extras: dict[str, Any]
    params: SamplingParams
    policy_version: int
    seed: int | None


@dataclass
class RolloutRecord:
    """One rollout so far: the response after `prompt_ids`, its mask, logprobs and versions, the
    turns' texts, rewards and steps, and the environment's last metadata and summed metrics."""

    prompt_ids: list[int]
    policy_version: int
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: per token, the engine's policy version (None once a turn came without them)
    versions: list[int] | None = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str = "length"
    turns: int = 0
    #: the rollout's images so far (a vision-language model's), one image token each in its ids
    images: list[Any] = field(default_factory=list)
    #: routing replay: the engine's routed experts of the ids so far (`skylift.generator.routed`)
    routed: Any = None
    #: after `replace_turn`, the response index of the turn's last token still trained
    _reward_at: int | None = None

    def turn_params(
        self, s: Any, params: SamplingParams, context: list[int], seed: int | None
    ) -> SamplingParams | None:
        """The next turn's sampling parameters (`s`: the generator's settings): the tokens left of
        the turn's and the rollout's budgets, the turn's seed; None (the rollout ends at its
        length) when no token is left."""
        max_total = s.max_input_length or (s.max_prompt_length + s.max_generate_length * s.max_turns)
        budget = min(params.max_tokens, s.max_generate_length, max_total - len(context))
        if budget <= 0:
            self.stop_reason = "length"
            return None
        turn_seed = None if seed is None else seed + self.turns * TURN_SEED_STRIDE
        return replace(params, max_tokens=budget, seed=turn_seed)

    def add_turn(self, s: Any, context: list[int], completion: Completion, text: str) -> list[int]:
        """Append a turn's sampled ids (trained) and its text; with step-wise trajectories also
        the turn as a step of prompt `context`. Returns the sampled ids."""
        self.turns += 1
        sampled = [int(t) for t in completion.token_ids]
        if self.versions is not None and completion.token_versions is not None and s.engine_versions:
            self.versions += completion.token_versions
        else:
            self.versions = None
        sampled_logprobs = list(completion.logprobs or [0.0] * len(sampled))
        self.stop_reason = completion.stop_reason
        length = len(context) + len(sampled)
        routed = routed_tokens(completion, length, getattr(s, "routed_experts", False))
        if s.step_wise:
            turn_versions = completion.token_versions if s.engine_versions else None
            self.steps.append(
                Step(list(context), sampled, sampled_logprobs, turn_versions, self.stop_reason, text, routed)
            )
        else:  # `context` is the ids so far: the turn's routing covers them
            self.routed = overlay(self.routed, routed, length)
        self.response_ids += sampled
        self.loss_mask += [1] * len(sampled)
        self.logprobs += sampled_logprobs
        self.texts.append(text)
        return sampled

    def replace_turn(self, sampled: list[int], new_ids: list[int], text: str) -> list[int]:
        """An environment's ``postprocessed_action``: the last turn's `sampled` ids become
        `new_ids` (its text `text`). The ids both share from the start stay trained with their
        logprobs; the rest of `new_ids` follows untrained (the policy never sampled them, so no
        logprob of the sampler exists for them). Returns `new_ids`."""
        keep = 0
        while keep < min(len(sampled), len(new_ids)) and sampled[keep] == new_ids[keep]:
            keep += 1
        cut = len(self.response_ids) - len(sampled) + keep
        self._reward_at = cut - 1 if keep else None
        del self.response_ids[cut:], self.loss_mask[cut:], self.logprobs[cut:]
        if self.routed is not None:  # the rewritten ids were never routed
            self.routed = self.routed[: len(self.prompt_ids) + cut]
        if self.versions is not None:
            del self.versions[cut:]
        self.add_untrained(new_ids[keep:])
        self.texts[-1] = text
        return new_ids

    def add_answer(self, reward: float, metrics: dict[str, Any] | None, metadata: dict[str, Any]) -> None:
        """The environment's answer to the turn: its reward (kept at the turn's last sampled
        token), its metrics (summed over turns) and its metadata (the last one kept)."""
        at = len(self.response_ids) - 1 if self._reward_at is None else self._reward_at
        self._reward_at = None
        self.turn_rewards.append((at, float(reward)))
        for name, value in (metrics or {}).items():
            self.metrics[name] = self.metrics.get(name, 0.0) + float(value)
        self.metadata = dict(metadata)

    def go_step_wise(self, s: Any, turns: list[TurnRecord]) -> Any:
        """This rollout goes on step-wise (``generator.on_template_mismatch=step_wise``): its `turns`
        so far become its steps. Returns the settings `s` it goes on with (``step_wise`` on)."""
        self.steps = steps_of_turns(self.prompt_ids + self.response_ids, turns, s.engine_versions)
        return replace(s, step_wise=True)

    def add_untrained(self, ids: list[int]) -> None:
        """Add `ids` after a turn without training on them (mask 0, logprob 0, the last version)."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        if self.versions is not None:
            self.versions += [self.versions[-1] if self.versions else self.policy_version] * len(ids)

    def finish(self, row: Any, s: Any) -> list[Trajectory]:
        """The rollout's trajectory (or steps); `s` is the generator's settings."""
        turn_rewards = self.turn_rewards
        if self.stop_reason != "stop" and s.zero_reward_on_non_stop:
            turn_rewards = [(index, 0.0) for index, _ in turn_rewards]
        total = sum(reward for _, reward in turn_rewards)
        if s.step_wise:
            return step_trajectories(
                row,
                self.steps,
                total,
                self.session_id,
                self.policy_version,
                overlong_filtering=s.apply_overlong_filtering,
                merge=s.merge_steps,
                metadata=self.metadata,
                metrics=self.metrics,
            )
        loss_mask = self.loss_mask
        if self.stop_reason != "stop" and s.apply_overlong_filtering:
            loss_mask = [0] * len(loss_mask)
        versions = self.versions
        trajectory = Trajectory(
            uid=row.uid,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=loss_mask,
            rollout_logprobs=self.logprobs,
            reward=total,
            stop_reason=self.stop_reason,
            data_source=row.data_source,
            num_turns=self.turns,
            policy_version=min(versions) if versions else self.policy_version,
            token_versions=versions or None,
            routed_experts=overlay(None, self.routed, len(self.prompt_ids) + len(self.response_ids)),
            env_metadata=self.metadata,
            response_text="\n".join(self.texts),
            turn_rewards=turn_rewards,
            metrics=self.metrics,
            images=self.images,
        )
        return [trajectory]
