"""Experience making from hand-made trajectories, checked against values computed by hand.

No engine, no worker, no Ray: the logprob and value functions are plain functions of the batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from skylift.config.algorithm import AlgorithmConfig
from skylift.generator import Trajectory
from skylift.rl.experience import ExperienceStages, make_experience
from skylift.rl.staleness import StalenessPolicy
from skylift.worker.batch import SequenceBatch


def traj(
    uid: str,
    reward: float,
    response: list[int],
    mask: list[int] | None = None,
    logprobs: list[float] | None = None,
    version: int = 0,
    stop: str = "stop",
) -> Trajectory:
    return Trajectory(
        uid=uid,
        prompt_ids=[7, 8],
        response_ids=response,
        loss_mask=mask if mask is not None else [1] * len(response),
        rollout_logprobs=logprobs if logprobs is not None else [-0.5] * len(response),
        reward=reward,
        stop_reason=stop,
        policy_version=version,
    )


def close(actual: torch.Tensor, expected: list[list[float]] | list[float], atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def stages(**algorithm: Any) -> ExperienceStages:
    """The stages of a `trainer.algorithm` group with these keys (the rest defaults)."""
    return ExperienceStages.of(AlgorithmConfig(**algorithm))


def never(batch: SequenceBatch) -> torch.Tensor:
    raise AssertionError("this quantity must not be computed for these settings")


def test_grpo_sequence_rewards_to_group_relative_advantages() -> None:
    # group "a": rewards 1 and 0 -> mean 0.5, unbiased std sqrt(0.5); group "b": equal rewards -> 0.
    # Row 1 is multi-turn: its middle token is the environment's (mask 0, no advantage).
    trajectories = [
        traj("a", 1.0, [1, 2]),
        traj("a", 0.0, [3, 4, 5], mask=[1, 0, 1], stop="length"),
        traj("b", 1.0, [6]),
        traj("b", 1.0, [7, 8]),
    ]
    exp = make_experience(
        trajectories, ExperienceStages.of(), policy_version=0, policy_logprobs=never, ref_logprobs=None
    )
    a = 0.5 / (0.5**0.5 + 1e-6)
    close(exp.batch.extras["advantages"], [[a, a, 0], [-a, 0, -a], [0, 0, 0], [0, 0, 0]])
    close(exp.batch.response_mask, [[1, 1, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0]])
    close(
        exp.batch.extras["rollout_logprobs"],
        [[-0.5, -0.5, 0], [-0.5, -0.5, -0.5], [-0.5, 0, 0], [-0.5, -0.5, 0]],
    )
    close(exp.rewards, [1.0, 0.0, 1.0, 1.0])
    assert "old_logprobs" not in exp.batch.extras  # on-policy, one update: the loss detaches its own
    assert "returns" not in exp.batch.extras and "values" not in exp.batch.extras
    m = exp.metrics
    assert m["reward/mean"] == pytest.approx(0.75)
    assert m["response_length/mean"] == pytest.approx((2 + 2 + 1 + 2) / 4)  # trained tokens only
    assert m["response/truncated_frac"] == pytest.approx(0.25)
    assert m["advantages/abs_mean"] == pytest.approx(4 * a / 7, abs=1e-6)  # over the 7 valid tokens
    assert m["async/staleness_max"] == 0.0


def test_grpo_without_std_and_batch_whitening() -> None:
    trajectories = [traj("a", 3.0, [1]), traj("a", 1.0, [2]), traj("b", 0.0, [3]), traj("b", 0.0, [4])]
    exp = make_experience(trajectories, stages(grpo_norm_by_std=False), policy_version=0)
    close(exp.batch.extras["advantages"], [[1.0], [-1.0], [0.0], [0.0]])
    # whitened over the batch's 4 valid tokens: mean 0, unbiased std sqrt(2/3)
    settings = stages(grpo_norm_by_std=False, advantage_batch_normalize=True)
    whitened = make_experience(trajectories, settings, policy_version=0).batch.extras["advantages"]
    s = (2 / 3) ** 0.5 + 1e-6
    close(whitened, [[1 / s], [-1 / s], [0.0], [0.0]])


def test_rloo_leave_one_out_baseline() -> None:
    trajectories = [
        traj("g", 1.0, [1, 2]),
        traj("g", 0.0, [3]),
        traj("g", 0.5, [4, 5]),
        traj("solo", 2.0, [6]),
    ]
    exp = make_experience(trajectories, stages(advantage_estimator="rloo"), policy_version=0)
    # 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0; a group of one: 0
    close(exp.batch.extras["advantages"], [[0.75, 0.75], [-0.75, 0], [0, 0], [0, 0]])


def test_gae_with_critic_values_and_returns() -> None:
    trajectories = [traj("p", 1.0, [1, 2, 3]), traj("q", 0.0, [4, 5])]
    seen: list[tuple[int, int]] = []

    def values(batch: SequenceBatch) -> torch.Tensor:
        seen.append(tuple(batch.response_mask.shape))
        return torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 0.0]])

    settings = stages(advantage_estimator="gae", grpo_norm_by_std=False, gamma=0.9, lambd=0.8)
    exp = make_experience(trajectories, settings, policy_version=0, values=values)
    assert seen == [(2, 3)]
    # row 0 (reward 1 on its last token): delta_2 = 1 - 0.7 = 0.3, A_2 = 0.3;
    # delta_1 = 0.9*0.7 - 0.6 = 0.03, A_1 = 0.03 + 0.72*0.3 = 0.246;
    # delta_0 = 0.9*0.6 - 0.5 = 0.04, A_0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1 (reward 0): A_1 = -0.4; A_0 = 0.9*0.4 - 0.2 + 0.72*(-0.4) = -0.128
    close(exp.batch.extras["advantages"], [[0.21712, 0.246, 0.3], [-0.128, -0.4, 0.0]])
    close(exp.batch.extras["returns"], [[0.71712, 0.846, 1.0], [0.072, 0.0, 0.0]])  # A + V
    close(exp.batch.extras["values"], [[0.5, 0.6, 0.7], [0.2, 0.4, 0.0]])


def test_kl_in_reward_penalises_tokens_before_grpo() -> None:
    trajectories = [
        traj("a", 1.0, [1, 2], logprobs=[-1.0, -1.2]),
        traj("a", 0.0, [3, 4], logprobs=[-2.0, -2.0]),
    ]

    def policy(batch: SequenceBatch) -> torch.Tensor:
        return torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])

    def ref(batch: SequenceBatch) -> torch.Tensor:
        return torch.tensor([[-1.5, -1.0], [-1.0, -2.0]])

    settings = ExperienceStages.of(
        AlgorithmConfig(
            grpo_norm_by_std=False, use_kl_in_reward=True, kl_loss_coef=0.1, kl_estimator_type="k1"
        ),
        StalenessPolicy(old_logprobs="trainer"),
    )
    exp = make_experience(trajectories, settings, policy_version=0, policy_logprobs=policy, ref_logprobs=ref)
    # k1 = old - ref = [[0.5, 0], [-1, 0]]; token rewards [[0, 1], [0, 0]] - 0.1 * k1
    # -> scores 0.95 and 0.1, group mean 0.525 -> advantages +-0.425
    close(exp.batch.extras["advantages"], [[0.425, 0.425], [-0.425, -0.425]])
    close(exp.batch.extras["old_logprobs"], [[-1.0, -1.0], [-2.0, -2.0]])
    close(exp.batch.extras["ref_logprobs"], [[-1.5, -1.0], [-1.0, -2.0]])
    assert exp.metrics["kl_in_reward/kl"] == pytest.approx(-0.125)
    assert exp.metrics["kl_in_reward/kl_coef"] == pytest.approx(0.1)
    # the trainer's logprobs of the sampled tokens vs the engine's: |0| |0.2| |0| |0| over 4 tokens
    assert exp.metrics["policy/logprob_diff_vs_rollout"] == pytest.approx(0.05)


def test_on_policy_distillation_rewards_each_token_with_the_teachers_log_ratio() -> None:
    """SkyRL's on_policy_distillation: reward_t = -(logp_t - teacher_logp_t), the environment's
    reward unused, no_op passes it through as the advantage."""

    def policy(batch: SequenceBatch) -> torch.Tensor:
        return torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])

    def teacher(batch: SequenceBatch) -> torch.Tensor:
        return torch.tensor([[-1.5, -1.0], [-1.0, -2.5]])

    settings = ExperienceStages.of(
        AlgorithmConfig(
            advantage_estimator="no_op",
            use_kl_in_reward=True,
            kl_loss_coef=0.1,  # replaced: the teacher's log-ratio is the whole reward
            kl_estimator_type="k3",
            on_policy_distillation=True,
        ),
        StalenessPolicy(old_logprobs="trainer"),
    )
    for env_reward in (0.0, 1.0):
        trajectories = [traj("a", env_reward, [1, 2]), traj("a", 0.5, [3, 4])]
        exp = make_experience(
            trajectories, settings, policy_version=0, policy_logprobs=policy, ref_logprobs=teacher
        )
        close(exp.batch.extras["advantages"], [[-0.5, 0.0], [1.0, -0.5]])
        assert exp.metrics["kl_in_reward/kl_coef"] == 1.0


def test_zero_variance_filter_masks_the_groups_without_a_reward_spread() -> None:
    """SkyRL's zero_variance_filter: group a (rewards 1, 1) is loss-masked; group b (1, 0) is kept;
    group c has one live trajectory (the other has no loss token) and is kept."""
    trajectories = [
        traj("a", 1.0, [1, 2]),
        traj("a", 1.0, [3, 4]),
        traj("b", 1.0, [5, 6]),
        traj("b", 0.0, [7, 8]),
        traj("c", 1.0, [9, 9]),
        traj("c", 1.0, [9, 8], mask=[0, 0]),
    ]
    settings = stages(grpo_norm_by_std=False, zero_variance_filter=True)
    exp = make_experience(trajectories, settings, policy_version=0)
    close(exp.batch.response_mask, [[0, 0], [0, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
    assert exp.metrics["reward/num_zero_variance_filtered"] == 1.0
    off = make_experience(trajectories, stages(grpo_norm_by_std=False, zero_variance_filter=False), 0)
    close(off.batch.response_mask, [[1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [0, 0]])
    assert "reward/num_zero_variance_filtered" not in off.metrics


def test_async_rollout_logprobs_are_the_anchor_and_staleness_is_bounded() -> None:
    trajectories = [
        traj("a", 1.0, [1], logprobs=[-0.3], version=2),
        traj("a", 0.0, [2], logprobs=[-0.7], version=2),
    ]
    settings = ExperienceStages.of(staleness=StalenessPolicy(max_staleness=1, old_logprobs="rollout"))
    exp = make_experience(trajectories, settings, policy_version=3, policy_logprobs=never)
    close(exp.batch.extras["old_logprobs"], [[-0.3], [-0.7]])
    assert exp.metrics["async/staleness_max"] == 1.0
    with pytest.raises(RuntimeError, match=r"staleness must be in \[0, 1\]"):
        make_experience(trajectories, settings, policy_version=4)
