"""Per-turn rewards: each turn's reward sits on its last sampled token; REINFORCE++ and GAE credit
a turn with the rewards from it on, GRPO sees the summed return unchanged; the per-turn means are
logged."""

from __future__ import annotations

import pytest
import torch

from skylift.config.algorithm import AlgorithmConfig
from skylift.generator import Trajectory, rollout_metrics, turn_reward_tensor
from skylift.rl.experience import ExperienceStages, make_experience


def two_turns(uid: str, rewards: tuple[float, float], stop: str = "stop") -> Trajectory:
    """Turn 1: tokens 0-1 (trained); observation: tokens 2-3 (untrained); turn 2: tokens 4-5."""
    return Trajectory(
        uid=uid,
        prompt_ids=[7, 8],
        response_ids=[10, 11, 90, 91, 12, 13],
        loss_mask=[1, 1, 0, 0, 1, 1],
        rollout_logprobs=[-0.5] * 6,
        reward=sum(rewards),
        stop_reason=stop,
        num_turns=2,
        turn_rewards=[(1, rewards[0]), (5, rewards[1])],
    )


def test_turn_rewards_land_on_each_turns_last_token() -> None:
    trajectories = [two_turns("a", (0.25, 1.0)), two_turns("a", (0.5, 0.0))]
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 2, dtype=torch.float32)
    rewards = turn_reward_tensor(trajectories, mask)
    assert rewards is not None
    torch.testing.assert_close(rewards, torch.tensor([[0, 0.25, 0, 0, 0, 1.0], [0, 0.5, 0, 0, 0, 0]]))
    assert turn_reward_tensor([Trajectory("a", [1], [2], [1], [0.0], 1.0, "stop")], mask[:1, :1]) is None


def test_a_reward_on_an_untrained_token_moves_to_the_trained_token_before_it() -> None:
    trajectory = two_turns("a", (0.25, 1.0))
    trajectory.loss_mask = [0, 1, 0, 0, 1, 0]  # turn 2's last token masked out
    mask = torch.tensor([trajectory.loss_mask], dtype=torch.float32)
    rewards = turn_reward_tensor([trajectory], mask)
    torch.testing.assert_close(rewards, torch.tensor([[0, 0.25, 0, 0, 1.0, 0]]))
    trajectory.turn_rewards = [(-1, 0.5), (5, 1.0)]  # a turn that sampled nothing before any token
    rewards = turn_reward_tensor([trajectory], mask)
    torch.testing.assert_close(rewards, torch.tensor([[0, 0.5, 0, 0, 1.0, 0]]))


def test_reinforce_pp_credits_each_turn_with_the_rewards_from_it_on() -> None:
    trajectories = [two_turns("a", (0.25, 1.0)), two_turns("b", (0.5, 0.0))]
    settings = ExperienceStages.of(
        AlgorithmConfig(advantage_estimator="reinforce++", gamma=1.0, advantage_batch_normalize=False)
    )
    exp = make_experience(trajectories, settings, policy_version=0)
    returns_before_whitening = torch.tensor([[1.25, 1.25, 0, 0, 1.0, 1.0], [0.5, 0.5, 0, 0, 0, 0]])
    mask = exp.batch.response_mask
    mean = (returns_before_whitening * mask).sum() / mask.sum()
    centred = (returns_before_whitening - mean) * mask
    adv = exp.batch.extras["advantages"]
    # whitened over the batch: the order and the differences between turns survive
    assert adv[0, 0] > adv[0, 4] > adv[1, 0] > adv[1, 4]
    assert torch.allclose(adv / adv.abs().max(), centred / centred.abs().max(), atol=1e-4)
    assert exp.metrics["reward/turn_1_mean"] == pytest.approx(0.375)
    assert exp.metrics["reward/turn_2_mean"] == pytest.approx(0.5)
    assert exp.metrics["rollout/turns_mean"] == 2.0


def test_grpo_sees_the_summed_return() -> None:
    per_turn = [two_turns("a", (0.25, 1.0)), two_turns("a", (0.5, 0.0))]
    summed = [two_turns("a", (0.25, 1.0)), two_turns("a", (0.5, 0.0))]
    for tr in summed:
        tr.turn_rewards = []
    a = make_experience(per_turn, ExperienceStages.of(), policy_version=0)
    b = make_experience(summed, ExperienceStages.of(), policy_version=0)
    torch.testing.assert_close(a.batch.extras["advantages"], b.batch.extras["advantages"])
    assert a.batch.extras["advantages"][0, 0] > 0 > a.batch.extras["advantages"][1, 0]


def test_gae_uses_the_turn_rewards() -> None:
    trajectories = [two_turns("a", (1.0, 0.0))]

    def zero_values(batch: object) -> torch.Tensor:
        return torch.zeros(1, 6)

    exp = make_experience(
        trajectories,
        ExperienceStages.of(AlgorithmConfig(advantage_estimator="gae", gamma=1.0, lambd=1.0)),
        0,
        values=zero_values,
    )
    # with zero values, GAE returns are the rewards to go: turn 1 earned 1.0, turn 2 nothing
    torch.testing.assert_close(exp.batch.extras["returns"][0], torch.tensor([1.0, 1.0, 0, 0, 0, 0]))


def test_rollout_metrics_average_env_metrics_and_turns() -> None:
    a, b = two_turns("a", (0.0, 1.0)), two_turns("a", (1.0, 0.0))
    a.metrics, b.metrics = {"tool_calls": 2.0}, {"tool_calls": 1.0, "tool_errors": 1.0}
    metrics = rollout_metrics([a, b])
    assert metrics["env/tool_calls"] == 1.5 and metrics["env/tool_errors"] == 0.5
    assert metrics["reward/turn_1_mean"] == 0.5 and metrics["reward/turn_2_mean"] == 0.5
