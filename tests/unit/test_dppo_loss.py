"""SkyRL's DPPO policy loss (``policy_loss_type=dppo``, skylift/algorithms/divergence_losses.py)
against values and gradients computed by hand, its anchor (the rollout logprobs when given), its
config keys (live, validated) and a run of the fake-parts loop with it.

Tolerances as in test_skyrl_losses.py: ``4 * ops * eps`` for a value behind ``ops`` rounded
operations (the ratios here are at most 1.6, so exp at most doubles a relative error).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rl_fakes import fake_run
from test_skyrl_training import LossPolicy

from skylift.algorithms import compute_policy_loss, policy_loss_names
from skylift.compat.skyrl.unused_keys import SKYRL_NOT_IMPLEMENTED, SKYRL_WITHOUT_EFFECT
from skylift.config import ConfigError, load_config
from skylift.config.algorithm import AlgorithmConfig, DPPOConfig
from skylift.rl.update import policy_objective

DTYPES = [torch.float32, torch.float64]


def close(actual: torch.Tensor, expected: list, ops: int) -> None:
    t = 4 * ops * torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=t, rtol=t)


def probs(p: list[float], m: list[float], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p requiring grad, log m): the policy's and the rollout's probabilities of the tokens."""
    logp = torch.log(torch.tensor([p], dtype=dtype)).requires_grad_(True)
    return logp, torch.log(torch.tensor([m], dtype=dtype))


def test_dppo_is_registered() -> None:
    assert "dppo" in policy_loss_names()


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_tv_drops_tokens_moved_past_the_bound_in_the_advantages_direction(dtype: torch.dtype) -> None:
    # rollout probability m = 0.5 everywhere; policy p and advantage A per token, t5 masked:
    # t0 p=0.8 A=+1: moved up 0.3 > 0.2 -> dropped; t1 p=0.6 A=+1: 0.1 -> kept, r = 1.2
    # t2 p=0.2 A=-1: moved down 0.3 > 0.2 -> dropped; t3 p=0.4 A=-2: 0.1 -> kept, r = 0.8
    # t4 p=0.8 A=-1: moved up, against a negative advantage: TV never drops it, r = 1.6
    logp, rollout = probs([0.8, 0.6, 0.2, 0.4, 0.8, 0.9], [0.5] * 6, dtype)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, -1.0, 3.0]], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=dtype)
    old = torch.zeros_like(rollout)  # not the anchor: the rollout logprobs are given
    loss, metrics = compute_policy_loss("dppo", logp, old, adv, mask, AlgorithmConfig(), rollout)
    # loss = -A r on kept tokens: -1.2, 1.6, 1.6
    close(loss, [[0.0, -1.2, 0.0, 1.6, 1.6, 0.0]], ops=4)
    loss.sum().backward()  # d(-A r)/dlogp = -A r: the same values, 0 on dropped tokens
    close(logp.grad, [[0.0, -1.2, 0.0, 1.6, 1.6, 0.0]], ops=4)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_max"] == pytest.approx(1.6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_kl_drops_by_the_bernoulli_kl_with_skyrls_bounds(dtype: torch.dtype) -> None:
    # m = 0.5; KL(Bern(m) || Bern(p)) = m ln(m / p) + (1 - m) ln((1 - m + e) / (1 - p + e)):
    # t0 p=0.8 A=+1: 0.5 ln(0.625) + 0.5 ln(2.5) = 0.22314 > 0.05 -> dropped
    # t1 p=0.55 A=+1: 0.5 ln(0.90909) + 0.5 ln(1.11111) = 0.00503 -> kept, r = 1.1
    # t2 p=0.2 A=-1: 0.22314, moved down -> dropped
    # t3 p=0.8 A=-1: moved up against a negative advantage -> kept, r = 1.6
    # t4 p=0.3 A=-1 with delta_low 0.1: 0.5 ln(5/3) + 0.5 ln(5/7) = 0.08718 < 0.1 -> kept, r = 0.6
    logp, rollout = probs([0.8, 0.55, 0.2, 0.8, 0.3], [0.5] * 5, dtype)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=dtype)
    cfg = AlgorithmConfig(dppo=DPPOConfig(dppo_type="binary_kl", delta_low=0.1, delta_high=0.05))
    loss, metrics = compute_policy_loss("dppo", logp, rollout, adv, torch.ones_like(adv), cfg, rollout)

    def kl(p: float, m: float = 0.5, e: float = 1e-8) -> float:
        return m * math.log(m / p) + (1 - m) * math.log((1 - m + e) / (1 - p + e))

    assert kl(0.8) == pytest.approx(0.223144, abs=1e-6) and kl(0.55) == pytest.approx(0.005025, abs=1e-6)
    assert kl(0.3) == pytest.approx(0.087177, abs=1e-6)
    close(loss, [[0.0, -1.1, 0.0, 1.6, 0.6]], ops=4)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    # delta_low 0.05: t4 (KL 0.087, moved down, A < 0) is dropped too
    tight = AlgorithmConfig(dppo=DPPOConfig(dppo_type="binary_kl", delta_low=0.05, delta_high=0.05))
    loss, _ = compute_policy_loss("dppo", logp, rollout, adv, torch.ones_like(adv), tight, rollout)
    close(loss, [[0.0, -1.1, 0.0, 1.6, 0.0]], ops=4)


def test_the_anchor_is_the_rollout_when_given_else_the_old_logprobs() -> None:
    logp, old = probs([0.9, 0.9], [0.9, 0.9], torch.float64)  # the old policy is the current one
    rollout = torch.log(torch.tensor([[0.5, 0.85]], dtype=torch.float64))
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    # against the rollout: t0 moved up 0.4 -> dropped; t1 up 0.05 -> kept, r = 0.9 / 0.85
    loss, _ = compute_policy_loss("dppo", logp, old, adv, mask, AlgorithmConfig(), rollout)
    close(loss, [[0.0, -0.9 / 0.85]], ops=4)
    # without rollout logprobs: the ratio to the old policy, 1, and nothing dropped
    loss, metrics = compute_policy_loss("dppo", logp, old, adv, mask, AlgorithmConfig())
    close(loss, [[-1.0, -1.0]], ops=4)
    assert metrics["clip_frac"] == 0.0


def test_dppo_keys_are_live_and_checked() -> None:
    declared = [*SKYRL_WITHOUT_EFFECT, *SKYRL_NOT_IMPLEMENTED]
    assert not any(key.startswith("trainer.algorithm.dppo") for key in declared)
    cfg = load_config(
        [
            "trainer.algorithm.policy_loss_type=dppo",
            "trainer.algorithm.dppo.dppo_type=binary_kl",
            "trainer.algorithm.dppo.delta_low=0.05",
            "trainer.algorithm.dppo.delta_high=0.07",
        ]
    )
    objective = policy_objective(cfg)
    lc = objective.algorithm
    assert objective.algorithm.policy_loss_type == "dppo"
    assert (lc.dppo.dppo_type, lc.dppo.delta_low, lc.dppo.delta_high) == ("binary_kl", 0.05, 0.07)
    with pytest.raises(ConfigError, match="binary_tv"):
        load_config(["trainer.algorithm.dppo.dppo_type=topk_tv"])
    with pytest.raises(ConfigError, match="delta_low"):
        load_config(["trainer.algorithm.dppo.delta_low=-0.1"])
    with pytest.raises(
        ConfigError, match=r"trainer\.algorithm\.dppo\.dppo_type='tv' is not one of binary_tv, binary_kl"
    ):
        load_config(["trainer.algorithm.dppo.dppo_type=tv"])


def test_dppo_trains_through_the_loop(tmp_path: Path) -> None:
    """Fake parts: the trainer's logprobs are the rollout's plus 0.1 on sample 1 (see LossPolicy).
    maxrl gives sample 0 (reward 0) A = -0.5 / (0.5 + 1e-6) at ratio 1 to its rollout: kept;
    sample 1 (A > 0) moved up by exp(lp) (e^0.1 - 1) > 0 = delta_high: dropped."""
    policy = LossPolicy()
    run = fake_run(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.algorithm.advantage_estimator=maxrl",
        "trainer.algorithm.policy_loss_type=dppo",
        "trainer.algorithm.dppo.delta_high=0.0",
        policy=policy,
    )
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert len(history) == 2 and len(policy.losses) == 2
    per_token = 0.5 / (0.5 + 1e-6)  # -A * r on sample 0's tokens; half the tokens: token_mean halves it
    eps32 = torch.finfo(torch.float32).eps
    for h, loss in zip(history, policy.losses, strict=True):
        assert math.isclose(loss, per_token / 2, rel_tol=64 * eps32)
        assert h["policy/clip_frac"] == pytest.approx(0.5)
