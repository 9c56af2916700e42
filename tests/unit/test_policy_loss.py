"""Policy losses checked against values (and gradients) computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from skylift.algorithms import (
    UnknownNameError,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    reduce_loss,
    register_policy_loss,
    unregister_policy_loss,
)
from skylift.config import ConfigError, load_config
from skylift.config.algorithm import AlgorithmConfig, CISPOConfig

DEFAULTS = AlgorithmConfig()  # the trainer.algorithm group at its defaults


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logprobs_with_ratios(
    ratios: list[list[float]], logp: list[list[float]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs requiring grad, old logprobs) such that exp(logprobs - old) == ratios."""
    r = torch.tensor(ratios, dtype=torch.float64)
    new = torch.tensor(logp, dtype=torch.float64) if logp is not None else torch.full_like(r, -1.0)
    old = new - torch.log(r)
    return new.clone().requires_grad_(True), old


def test_regular_ppo_clip_asymmetric() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -1, -1; eps_low 0.2, eps_high 0.28; token 4 masked.
    logp, old = logprobs_with_ratios([[1.5, 0.5, 1.1, 0.7, 50.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    loss, metrics = compute_policy_loss("regular", logp, old, adv, mask, cfg)
    # t0: max(-1*1.5, -1*1.28) = -1.28 (clipped)   t1: max(-0.5, -0.8) = -0.5
    # t2: max(1.1, 1.1) = 1.1                       t3: max(0.7, 0.8) = 0.8 (clipped)   t4: masked -> 0
    close(loss, [[-1.28, -0.5, 1.1, 0.8, 0.0]])
    assert metrics["clip_frac"] == pytest.approx(0.5)  # 2 of 4 valid tokens
    # ppo_kl = mean(-log r) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 0.7)/4 = 0.137262
    assert metrics["ppo_kl"] == pytest.approx(0.137262, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 on clipped ones: 0, -0.5, 1.1, 0, 0
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 1.1, 0.0, 0.0]])


def test_dual_clip_caps_negative_advantages() -> None:
    logp, old = logprobs_with_ratios([[5.0, 5.0, 0.5, 2.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, metrics = compute_policy_loss("dual_clip", logp, old, adv, mask, AlgorithmConfig(clip_ratio_c=3.0))
    # t0: ppo = max(5, 1.2) = 5; A<0 -> min(5, 1*3) = 3 (dual clip)
    # t1: A>0 -> ppo = max(-5, -1.2) = -1.2
    # t2: ppo = max(0.5, 0.8) = 0.8; min(0.8, 3) = 0.8
    # t3: ppo = max(4, 2.4) = 4; min(4, 2*3 = 6) = 4
    close(loss, [[3.0, -1.2, 0.8, 4.0]])
    assert metrics["dual_clip_frac"] == pytest.approx(0.25)
    assert metrics["clip_frac"] == pytest.approx(0.5)  # t1 and t2
    loss.sum().backward()
    # only t3 (unclipped, -A r = 2*2 = 4) carries a gradient: d/dlogp = 4
    close(logp.grad, [[0.0, 0.0, 0.0, 4.0]])


def test_gspo_sequence_ratio_and_clip() -> None:
    # seq 0: token log-ratios 0.3, -0.1, 0.1 -> mean 0.1 -> s = exp(0.1) = 1.105171 (inside [0.8, 1.2])
    # seq 1: token log-ratios 0.6, 0.4 (third token masked) -> mean 0.5 -> s = exp(0.5) = 1.648721 -> clipped
    log_ratios = torch.tensor([[0.3, -0.1, 0.1], [0.6, 0.4, 9.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - log_ratios
    adv = torch.ones(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gspo", logp, old, adv, mask, DEFAULTS)
    # every token carries its sequence's term: seq 0 -> -1.105171; seq 1 -> max(-1.648721, -1.2) = -1.2
    close(loss, [[-1.105171, -1.105171, -1.105171], [-1.2, -1.2, 0.0]])
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    loss.sum().backward()
    # seq 0 unclipped: d/dlogp_t (-A sg(s) exp(logp_t - sg(logp_t))) = -s; seq 1 clipped: 0
    close(logp.grad, [[-1.105171] * 3, [0.0, 0.0, 0.0]])


def test_gspo_gradient_is_gradient_of_sequence_ratio() -> None:
    torch.manual_seed(0)
    logp = (torch.randn(3, 4, dtype=torch.float64) * 0.1 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 4, dtype=torch.float64) * 0.01
    adv = torch.tensor([[0.7], [-1.3], [0.2]], dtype=torch.float64).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        "gspo", logp, old, adv, mask, AlgorithmConfig(eps_clip_low=0.5, eps_clip_high=0.5)
    )
    assert metrics["clip_frac"] == 0.0
    reduce_loss(loss, mask, "sequence_mean").backward()
    got = logp.grad.clone()

    # the GSPO objective written directly: mean over sequences of -A_i * exp(mean_t log r_it)
    logp.grad = None
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    (-(adv[:, 0] * seq_ratio)).mean().backward()
    torch.testing.assert_close(got, logp.grad, atol=1e-12, rtol=0)


def test_cispo_clipped_stop_gradient_weight() -> None:
    # ratios 1.5, 0.5, 1.0; advantages 1, -1, 2; logp -1, -2, -0.5; cispo eps_low 0.2, eps_high 0.28
    logp, old = logprobs_with_ratios([[1.5, 0.5, 1.0]], logp=[[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    cfg = AlgorithmConfig(cispo=CISPOConfig(cispo_eps_clip_low=0.2, cispo_eps_clip_high=0.28))
    loss, metrics = compute_policy_loss("cispo", logp, old, adv, mask, cfg)
    # weights sg(clip(r)) = 1.28, 0.8, 1.0; loss = -w A logp:
    #   -1.28*1*(-1) = 1.28;  -0.8*(-1)*(-2) = -1.6;  -1*2*(-0.5) = 1.0
    close(loss, [[1.28, -1.6, 1.0]])
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    loss.sum().backward()
    # gradient -w A: every token keeps one, even the clipped ones
    close(logp.grad, [[-1.28, 0.8, -2.0]])


def test_cispo_reads_its_own_clip_bounds_not_ppo_ones() -> None:
    # ratios 1.5 and 0.5, advantages 1, logp -1: PPO's eps_clip_* (set absurdly tight here) do not
    # touch CISPO; its defaults (low 0, high 5) clip the weights to [1, 6] -> 1.5 and 1.0
    logp, old = logprobs_with_ratios([[1.5, 0.5]], logp=[[-1.0, -1.0]])
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    cfg = AlgorithmConfig(eps_clip_low=0.01, eps_clip_high=0.01)
    loss, metrics = compute_policy_loss("cispo", logp, old, adv, mask, cfg)
    close(loss, [[1.5, 1.0]])  # -w * A * logp = w
    assert metrics["clip_frac"] == pytest.approx(0.5)  # only 0.5 < 1 - 0 is outside
    # and the cispo bounds do not touch the PPO loss: eps 0.2 clips r = 1.5 to 1.2 for A > 0
    ppo, _ = compute_policy_loss(
        "regular", logp, old, adv, mask, AlgorithmConfig(cispo=CISPOConfig(cispo_eps_clip_high=0.0))
    )
    close(ppo, [[-1.2, -0.5]])
    with pytest.raises(ConfigError, match=r"trainer\.algorithm\.cispo\.cispo_eps_clip_low=-0.1 must be >= 0"):
        load_config(["trainer.algorithm.cispo.cispo_eps_clip_low=-0.1"])


def test_truncated_importance_sampling() -> None:
    logp, old = logprobs_with_ratios([[1.0, 1.0]])
    rollout = old - torch.tensor([[math.log(3.0), math.log(0.5)]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    cfg = AlgorithmConfig(use_tis=True, tis_imp_ratio_cap=2.0)
    loss, metrics = compute_policy_loss("regular", logp, old, adv, mask, cfg, rollout_logprobs=rollout)
    # old/rollout ratios 3 and 0.5 -> weights min(3, 2) = 2 and 0.5; ppo loss -1 each -> -2, -0.5
    close(loss, [[-2.0, -0.5]])
    assert metrics["tis_weight_mean"] == pytest.approx(1.25)
    assert metrics["tis_clip_frac"] == pytest.approx(0.5)
    loss.sum().backward()
    close(logp.grad, [[-2.0, -0.5]])  # the weight is a constant: d/dlogp (-w r) = -w r
    with pytest.raises(ValueError, match="rollout_logprobs were not given"):
        compute_policy_loss("regular", logp, old, adv, mask, cfg)


def test_masked_tokens_cannot_leak_nan_or_inf() -> None:
    logp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]])
    adv = torch.tensor([[1.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0]])
    for name in policy_loss_names():
        logp.grad = None
        rollout = torch.tensor([[-1.0, float("nan")]])  # read by rollout-anchored losses only
        loss, metrics = compute_policy_loss(name, logp, old, adv, mask, DEFAULTS, rollout_logprobs=rollout)
        assert loss[0, 1].item() == 0.0, name
        assert torch.isfinite(loss).all(), name
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
        reduce_loss(loss, mask, "token_mean").backward()
        assert torch.isfinite(logp.grad).all(), (name, logp.grad)
        assert logp.grad[0, 1].item() == 0.0, name


def test_all_masked_batch_gives_zero_loss_and_finite_metrics() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    for name in policy_loss_names():
        zeros = torch.zeros(2, 3)
        loss, metrics = compute_policy_loss(
            name, logp, zeros, torch.ones(2, 3), mask, DEFAULTS, rollout_logprobs=zeros
        )
        assert reduce_loss(loss, mask, "token_mean").item() == 0.0
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)


def test_config_validation() -> None:
    a = "trainer.algorithm"
    with pytest.raises(ConfigError, match=rf"{a}\.clip_ratio_c=1.0 must be > 1"):
        load_config([f"{a}.policy_loss_type=dual_clip", f"{a}.clip_ratio_c=1.0"])
    with pytest.raises(ConfigError, match=rf"{a}\.eps_clip_low=-0.1 must be >= 0"):
        load_config([f"{a}.eps_clip_low=-0.1"])
    with pytest.raises(ConfigError, match=rf"{a}\.use_tis=true needs {a}\.tis_imp_ratio_cap > 0"):
        load_config([f"{a}.use_tis=true", f"{a}.tis_imp_ratio_cap=0.0"])


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match=r"advantages shape \(1, 2\) != logprobs shape \(1, 3\)"):
        compute_policy_loss(
            "regular", torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), DEFAULTS
        )


def test_unknown_loss_names_it_and_lists_known() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_policy_loss("ppo2")
    message = str(info.value)
    assert "'ppo2'" in message
    for known in ("cispo", "dual_clip", "gspo", "regular"):
        assert known in message


def test_user_registered_loss() -> None:
    @register_policy_loss("test_neg_logp")
    def neg_logp(logprobs, old_logprobs, advantages, response_mask, config):  # type: ignore[no-untyped-def]
        return -advantages * logprobs, {"custom": 1.0}

    try:
        loss, metrics = compute_policy_loss(
            "test_neg_logp",
            torch.tensor([[-2.0, -1.0]]),
            torch.zeros(1, 2),
            torch.tensor([[0.5, 3.0]]),
            torch.tensor([[1.0, 0.0]]),
            DEFAULTS,
        )
        close(loss, [[1.0, 0.0]])  # -0.5 * -2 = 1; masked token -> 0
        assert metrics == {"custom": 1.0}
    finally:
        unregister_policy_loss("test_neg_logp")
