"""Advantage estimators checked against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from skylift.algorithms import (
    UnknownNameError,
    advantage_estimator_names,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
    sequence_rewards_to_token_level,
    unregister_advantage_estimator,
)


def close(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_sequence_reward_goes_on_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = sequence_rewards_to_token_level([2.0, 3.0, 4.0, 5.0], mask)
    # row 1 has a gap (multi-turn): its last valid token is index 2; row 2 has none -> no reward.
    close(out, [[0, 0, 2, 0], [0, 0, 3, 0], [0, 0, 0, 0], [0, 0, 0, 5]])


def test_sequence_reward_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match=r"rewards must have shape \(2,\)"):
        sequence_rewards_to_token_level([1.0, 2.0, 3.0], torch.ones(2, 3))


# GRPO batch: group "a" = rows 0-2 with scores 1, 0, 1 (row 2 spreads its score over two tokens,
# 0.5 + 0.5); group "b" = rows 3-4 with identical scores 2, 2; group "c" = row 5 alone (score 5).
GRPO_REWARDS = torch.tensor(
    [
        [0.0, 0.0, 1.0],
        [0.0, 0.0, 0.0],
        [0.5, 0.5, 0.0],
        [0.0, 2.0, 0.0],
        [2.0, 0.0, 0.0],
        [0.0, 5.0, 0.0],
    ]
)
GRPO_MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0],
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 1.0],
    ]
)
GRPO_GROUPS = ["a", "a", "a", "b", "b", "c"]


def test_grpo_with_std_normalisation() -> None:
    adv, returns = compute_advantages("grpo", GRPO_REWARDS, GRPO_MASK, group_ids=GRPO_GROUPS)
    # group a: mean = 2/3; deviations 1/3, -2/3, 1/3; unbiased var = (1/9 + 4/9 + 1/9) / 2 = 1/3,
    # std = 0.577350 -> advantages 0.333333/0.577350 = 0.577350 and -0.666667/0.577350 = -1.154701.
    # group b: identical scores -> 0 / (0 + eps) = 0.  group c: alone -> score - own mean = 0.
    a, m = 0.577350, -1.154701
    close(
        adv,
        [[a, a, a], [m, m, 0], [a, a, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    )
    assert torch.equal(adv, returns)
    assert torch.isfinite(adv).all()


def test_grpo_without_std_normalisation() -> None:
    adv, _ = compute_advantages("grpo", GRPO_REWARDS, GRPO_MASK, group_ids=GRPO_GROUPS, norm_by_std=False)
    # group a: score - 2/3 -> 1/3, -2/3, 1/3; groups b and c -> 0.
    p, m = 1 / 3, -2 / 3
    close(adv, [[p, p, p], [m, m, 0], [p, p, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_grpo_all_masked_row_and_tensor_group_ids() -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [float("nan"), 7.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    adv, _ = compute_advantages("grpo", rewards, mask, group_ids=torch.tensor([3, 3, 3]), norm_by_std=False)
    # the masked NaN/7 are ignored: scores 1, 0, 0 -> mean 1/3 -> 2/3, -1/3, (row 2 masked) 0.
    close(adv, [[2 / 3, 0], [-1 / 3, -1 / 3], [0, 0]])
    assert torch.isfinite(adv).all()


def test_grpo_needs_group_ids_of_batch_length() -> None:
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages("grpo", GRPO_REWARDS, GRPO_MASK)
    with pytest.raises(ValueError, match="group_ids has 2 entries but the batch has 6"):
        compute_advantages("grpo", GRPO_REWARDS, GRPO_MASK, group_ids=["a", "b"])


def test_rloo_leave_one_out_baseline() -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.5], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv, returns = compute_advantages("rloo", rewards, mask, group_ids=["g", "g", "g", "solo"])
    # group g, scores 1, 0, 0.5:
    #   row 0: 1   - (0 + 0.5)/2 = 0.75;  row 1: 0 - (1 + 0.5)/2 = -0.75;  row 2: 0.5 - (1 + 0)/2 = 0
    # "solo" has nobody to compare with -> 0.
    close(adv, [[0.75, 0], [-0.75, -0.75], [0, 0], [0, 0]])
    assert torch.equal(adv, returns)


def test_reinforce_plus_plus_returns_and_whitening() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, returns = compute_advantages("reinforce++", rewards, mask, gamma=0.5)
    # returns with gamma 0.5: row 0: G2 = 1, G1 = 0.5, G0 = 0.25; row 1: G1 = -1, G0 = -0.5.
    close(returns, [[0.25, 0.5, 1.0, 0], [-0.5, -1.0, 0, 0]])
    # whitening over the 5 valid returns: mean = 0.25/5 = 0.05; deviations 0.2, 0.45, 0.95, -0.55,
    # -1.05; unbiased var = (0.04 + 0.2025 + 0.9025 + 0.3025 + 1.1025)/4 = 0.6375, std = 0.798436.
    close(
        adv,
        [[0.250490, 0.563602, 1.189826, 0], [-0.688847, -1.315071, 0, 0]],
    )


def test_reinforce_plus_plus_skips_masked_gap() -> None:
    # multi-turn: token 1 is an environment token; its reward is ignored and it is not a step.
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, returns = compute_advantages("reinforce++", rewards, mask, gamma=0.5)
    # G2 = 1; G0 = 0 + 0.5 * G2 = 0.5 (one discount step, not two).
    close(returns, [[0.5, 0.0, 1.0]])
    # whitening: mean 0.75, deviations -0.25, 0.25, unbiased std = sqrt(0.125/1) = 0.353553.
    close(adv, [[-0.707107, 0.0, 0.707107]])


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0], [0.2, 9.0, 0.4, 9.0]])
    adv, returns = compute_advantages(
        "gae", rewards, mask, values=values, gamma=0.9, lambd=0.8, norm_by_std=False
    )
    # row 0 (gamma*lambda = 0.72):
    #   t2: delta = 1 + 0.9*0 - 0.5 = 0.5;            A2 = 0.5
    #   t1: delta = 0 + 0.9*0.5 - 0.5 = -0.05;        A1 = -0.05 + 0.72*0.5  = 0.31
    #   t0: delta = -0.05;                            A0 = -0.05 + 0.72*0.31 = 0.1732
    # row 1 (token 1 masked: its reward 2 and value 9 are skipped):
    #   t2: delta = 0 + 0 - 0.4 = -0.4;               A2 = -0.4
    #   t0: delta = 0 + 0.9*0.4 - 0.2 = 0.16;         A0 = 0.16 + 0.72*(-0.4) = -0.128
    close(adv, [[0.1732, 0.31, 0.5, 0], [-0.128, 0, -0.4, 0]])
    # returns = A + V: 0.6732, 0.81, 1.0 and 0.072, 0.0
    close(returns, [[0.6732, 0.81, 1.0, 0], [0.072, 0, 0.0, 0]])

    whitened, returns_w = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lambd=0.8)
    torch.testing.assert_close(returns_w, returns)
    # valid advantages 0.1732, 0.31, 0.5, -0.128, -0.4: mean = 0.4552/5 = 0.09104;
    # unbiased var = (0.006750 + 0.047943 + 0.167248 + 0.047979 + 0.241120)/4 = 0.127760, std 0.357436
    # -> 0.08216/0.357436 = 0.229860, 0.21896/.. = 0.612586, 0.40896/.. = 1.144150, -0.21904/.. = -0.612810,
    #    -0.49104/.. = -1.373786
    close(whitened, [[0.229860, 0.612586, 1.144150, 0], [-0.612810, 0, -1.373786, 0]])


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", torch.zeros(1, 2), torch.ones(1, 2))


def test_estimators_do_not_track_gradients() -> None:
    rewards = torch.tensor([[1.0, 2.0]], requires_grad=True)
    adv, _ = compute_advantages("reinforce++", rewards, torch.ones(1, 2))
    assert not adv.requires_grad


def test_unknown_estimator_names_it_and_lists_known() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_advantage_estimator("grpoo")
    message = str(info.value)
    assert "'grpoo'" in message
    for known in ("gae", "grpo", "reinforce++", "rloo"):
        assert known in message
    with pytest.raises(UnknownNameError, match="grpoo"):
        compute_advantages("grpoo", torch.zeros(1, 1), torch.ones(1, 1))


def test_user_registered_estimator_is_used_and_duplicates_refused() -> None:
    @register_advantage_estimator("test_constant_two")
    def constant_two(*, token_level_rewards, response_mask, **_):  # type: ignore[no-untyped-def]
        return 2.0 * response_mask, response_mask

    try:
        assert "test_constant_two" in advantage_estimator_names()
        adv, _ = compute_advantages("test_constant_two", torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
        close(adv, [[2.0, 2.0, 0.0]])
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant_two")(constant_two)
    finally:
        unregister_advantage_estimator("test_constant_two")
    assert "test_constant_two" not in advantage_estimator_names()
