"""SkyRL's policy losses (sapo, clip_cov, kl_cov, rollout_is), its maxrl advantage estimator and its
off-policy corrections (sequence TIS, geometric / product / outlier / token masks), each checked
against values and gradients computed by hand on small tensors.

Tolerances come from the dtype and the number of rounded operations behind a value: each
elementary operation is exact to half an ulp, the inputs (a log of a ratio, a difference of
logprobs) carry one rounding each, and exp / sigmoid at most double a relative error for the
ratios used here (|r| <= 2), hence ``4 * ops * eps`` relative (and absolute, the values being O(1)).
"""

from __future__ import annotations

import math

import pytest
import torch

from skylift.algorithms import (
    compute_advantages,
    compute_policy_loss,
    policy_loss_names,
)
from skylift.config import ConfigError, load_config
from skylift.config.algorithm import (
    AlgorithmConfig,
    ClipCovConfig,
    KLCovConfig,
    OffPolicyCorrectionConfig,
    SAPOConfig,
)

DEFAULTS = AlgorithmConfig()  # the trainer.algorithm group at its defaults
A = "trainer.algorithm"

DTYPES = [torch.float32, torch.float64]


def tol(dtype: torch.dtype, ops: int) -> float:
    return 4 * ops * torch.finfo(dtype).eps


def close(actual: torch.Tensor, expected: list, ops: int) -> None:
    t = tol(actual.dtype, ops)
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=t, rtol=t)


def with_ratios(
    ratios: list[list[float]], logp: list[list[float]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs requiring grad, old logprobs) with exp(logprobs - old) == ratios."""
    new = torch.tensor(logp, dtype=dtype)
    old = new - torch.log(torch.tensor(ratios, dtype=dtype))
    return new.clone().requires_grad_(True), old


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_the_registry_holds_skyrls_losses() -> None:
    assert {"sapo", "clip_cov", "kl_cov", "rollout_is"} <= set(policy_loss_names())


# ---------------------------------------------------------------------------------------- sapo
@pytest.mark.parametrize("dtype", DTYPES)
def test_sapo_soft_gate_and_its_gradient(dtype: torch.dtype) -> None:
    # r = 1.5, 0.5, 1, 2 with A = +1, +1, -1, -2; tau_pos 1 (A > 0), tau_neg 1.05 (A <= 0); t4 masked
    logp, old = with_ratios([[1.5, 0.5, 1.0, 2.0, 7.0]], [[-1.0, -2.0, -0.5, -1.5, -1.0]], dtype)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 3.0]], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=dtype)
    loss, _ = compute_policy_loss("sapo", logp, old, adv, mask, DEFAULTS)
    cases = [(1.0, 1.5, 1.0), (1.0, 0.5, 1.0), (-1.0, 1.0, 1.05), (-2.0, 2.0, 1.05)]  # (A, r, tau)
    # loss = -A * (4 / tau) * sigmoid(tau * (r - 1)): -4 s(0.5) = -2.48984, -4 s(-0.5) = -1.51016,
    # 4 / 1.05 * s(0) = 1.90476, 2 * 4 / 1.05 * s(1.05) = 5.64400
    close(loss, [[-a * 4 / t * sigmoid(t * (r - 1)) for a, r, t in cases] + [0.0]], ops=8)
    # d/dlogp = -A * 4 * s (1 - s) * r; at r = 1 it is PPO's -A r (1.0 on t2)
    loss.sum().backward()
    grads = [-a * 4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1))) * r for a, r, t in cases]
    assert grads[2] == pytest.approx(1.0)
    close(logp.grad, [[*grads, 0.0]], ops=12)


def test_sapo_temperatures_come_from_the_config() -> None:
    logp, old = with_ratios([[2.0, 2.0]], [[-1.0, -1.0]], torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cfg = AlgorithmConfig(sapo=SAPOConfig(tau_pos=2.0, tau_neg=0.5))
    loss, _ = compute_policy_loss("sapo", logp, old, adv, torch.ones(1, 2, dtype=torch.float64), cfg)
    close(loss, [[-2 * sigmoid(2.0), 8 * sigmoid(0.5)]], ops=8)
    with pytest.raises(ConfigError, match=rf"{A}\.sapo\.tau_neg=0.0 must be > 0"):
        load_config([f"{A}.sapo.tau_neg=0.0"])


# ----------------------------------------------------------------------------------- clip_cov
# A = 2, 1, -1, -2 (mean 0) and logp = 0, -0.5, -1.5, -2 (mean -1): covariance (A - 0)(logp + 1)
# = 2, 0.5, 0.5, 2; with (lb, ub) = (1, 5) tokens 0 and 3 are the candidates. Token 4 is masked and
# must not move the means.
ADV = [[2.0, 1.0, -1.0, -2.0, 50.0]]
LOGP = [[0.0, -0.5, -1.5, -2.0, -30.0]]
MASK = [[1.0, 1.0, 1.0, 1.0, 0.0]]


def _clip_cov(ratios: list[list[float]], cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict, torch.Tensor]:
    logp, old = with_ratios(ratios, LOGP, torch.float64)
    adv, mask = torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)
    loss, metrics = compute_policy_loss("clip_cov", logp, old, adv, mask, cfg)
    loss.sum().backward()
    assert logp.grad is not None
    return loss, metrics, logp.grad


def test_clip_cov_drops_every_candidate_when_the_share_allows() -> None:
    # share 0.5 of 4 valid tokens = 2 >= the 2 candidates: both dropped; r = 1 -> PPO loss -A
    loss, metrics, grad = _clip_cov([[1.0] * 5], AlgorithmConfig(clip_cov=ClipCovConfig(clip_ratio=0.5)))
    close(loss, [[0.0, -1.0, 1.0, 0.0, 0.0]], ops=4)
    close(grad, [[0.0, -1.0, 1.0, 0.0, 0.0]], ops=4)  # dropped tokens have no gradient
    assert metrics["cov_clip_frac"] == pytest.approx(0.5) and metrics["clip_frac"] == 0.0


def test_clip_cov_draws_its_default_single_token_at_random_among_the_candidates() -> None:
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        loss, metrics, _ = _clip_cov([[1.0] * 5], DEFAULTS)  # 0.0002 * 4 -> at least 1
        dropped = [t for t in range(4) if loss[0, t].item() == 0.0]
        assert len(dropped) == 1 and dropped[0] in (0, 3) and metrics["cov_clip_frac"] == 0.25
        seen.add(dropped[0])
    assert seen == {0, 3}


def test_clip_cov_never_drops_a_token_the_ppo_clip_took() -> None:
    # r0 = 1.5 with A = 2 > 0 is clipped at 1.2 -> not a candidate; only token 3 is dropped
    loss, metrics, grad = _clip_cov(
        [[1.5, 1.0, 1.0, 1.0, 1.0]], AlgorithmConfig(clip_cov=ClipCovConfig(clip_ratio=1.0))
    )
    close(loss, [[-2.4, -1.0, 1.0, 0.0, 0.0]], ops=4)
    close(grad, [[0.0, -1.0, 1.0, 0.0, 0.0]], ops=4)
    assert metrics["clip_frac"] == 0.25 and metrics["cov_clip_frac"] == 0.25


def test_clip_cov_bounds_are_exclusive_and_checked() -> None:
    loss, metrics, _ = _clip_cov(
        [[1.0] * 5], AlgorithmConfig(clip_cov=ClipCovConfig(clip_ratio=1.0, clip_cov_lb=2.0))
    )
    close(loss, [[-2.0, -1.0, 1.0, 2.0, 0.0]], ops=4)  # cov 2 is not > 2: nothing dropped
    assert metrics["cov_clip_frac"] == 0.0
    with pytest.raises(
        ConfigError, match=rf"{A}\.clip_cov\.clip_cov_lb=5.0 must be < {A}\.clip_cov\.clip_cov_ub=5.0"
    ):
        load_config([f"{A}.clip_cov.clip_cov_lb=5.0"])


# ------------------------------------------------------------------------------------- kl_cov
@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_cov_penalises_the_tokens_of_largest_covariance(dtype: torch.dtype) -> None:
    # logp = 0, -0.5, -1.5, -2.2 (mean -1.05): covariance 2 * 1.05, 1 * 0.55, -1 * -0.45, -2 * -1.15
    # = 2.1, 0.55, 0.45, 2.3. Share 0.5 of 4 -> tokens 3 and 0 get + |log r|; no PPO clip anywhere.
    logp, old = with_ratios([[1.1, 0.9, 1.2, 0.8, 1.0]], [[0.0, -0.5, -1.5, -2.2, -9.0]], dtype)
    adv = torch.tensor(ADV, dtype=dtype)
    mask = torch.tensor(MASK, dtype=dtype)
    loss, metrics = compute_policy_loss(
        "kl_cov", logp, old, adv, mask, AlgorithmConfig(kl_cov=KLCovConfig(kl_cov_frac=0.5))
    )
    # -A r + |ln r|: -2.2 + ln 1.1 = -2.10469; -0.9 ... 1.2; 1.6 + |ln 0.8| = 1.82314
    close(loss, [[-2.2 + math.log(1.1), -0.9, 1.2, 1.6 - math.log(0.8), 0.0]], ops=6)
    assert metrics["kl_cov_frac"] == pytest.approx(0.5)
    loss.sum().backward()
    close(logp.grad, [[-2.2 + 1.0, -0.9, 1.2, 1.6 - 1.0, 0.0]], ops=6)  # + coef * sign(log r)
    # the default share 0.2 of 4 tokens -> at least one: token 3 only; coefficient 2
    logp.grad = None
    loss, _ = compute_policy_loss(
        "kl_cov", logp, old, adv, mask, AlgorithmConfig(kl_cov=KLCovConfig(ppo_kl_coef=2.0))
    )
    close(loss, [[-2.2, -0.9, 1.2, 1.6 - 2 * math.log(0.8), 0.0]], ops=6)


# --------------------------------------------------------------------------------- rollout_is
def test_rollout_is_weights_by_the_ratio_to_the_rollout_inside_the_band_only() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.log(torch.tensor([[1.1, 1.5, 0.7]], dtype=torch.float64))
    old = torch.zeros(1, 3, dtype=torch.float64)  # not the anchor of this loss
    adv, mask = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        "rollout_is", logp, old, adv, mask, DEFAULTS, rollout_logprobs=rollout
    )
    # r' = 1.1 inside (0.8, 1.2): -1.1 * A * logp = 1.1; 1.5 and 0.7 outside -> 0
    close(loss, [[1.1, 0.0, 0.0]], ops=4)
    loss.sum().backward()
    close(logp.grad, [[-1.1, 0.0, 0.0]], ops=4)  # the weight is a constant
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="policy loss 'rollout_is' needs the rollout engine's logprobs"):
        compute_policy_loss("rollout_is", logp, old, adv, mask, DEFAULTS)


# -------------------------------------------------------------------------------------- maxrl
def test_maxrl_divides_the_centred_reward_by_the_group_mean() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    mask = torch.ones(7, 2, dtype=torch.float64)
    adv, returns = compute_advantages("maxrl", rewards, mask, groups, eps=1e-6)
    # group a: mean 0.25 -> 0.75 / 0.250001 and -0.25 / 0.250001; group b: mean 0 -> 0;
    # group c has one sequence: its score, as in SkyRL
    a_pos, a_neg = 0.75 / (0.25 + 1e-6), -0.25 / (0.25 + 1e-6)
    expected = [a_pos, a_neg, a_neg, a_neg, 0.0, 0.0, 1.0]
    close(adv, [[e, e] for e in expected], ops=4)
    assert torch.equal(adv, returns)


# ---------------------------------------------------------------------- off-policy corrections
def _corrected(
    w: list[list[float]],
    c: OffPolicyCorrectionConfig,
    dtype: torch.dtype = torch.float64,
    **algorithm: float | bool,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The regular loss at r = 1 with A = 1 (-1 per token) under correction `c` (and the other
    `algorithm` keys), where the trainer's old logprobs are w times the rollout's; returns (loss,
    metrics, gradient)."""
    shape = (len(w), len(w[0]))
    logp = torch.full(shape, -1.0, dtype=dtype, requires_grad=True)
    rollout = logp.detach() - torch.log(torch.tensor(w, dtype=dtype))
    loss, metrics = compute_policy_loss(
        "regular",
        logp,
        logp.detach(),
        torch.ones(shape, dtype=dtype),
        torch.ones(shape, dtype=dtype),
        AlgorithmConfig(off_policy_correction=c, **algorithm),  # type: ignore[arg-type]
        rollout_logprobs=rollout,
    )
    loss.sum().backward()
    assert logp.grad is not None
    return loss, metrics, logp.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_tis_weighs_each_sequence_by_its_capped_product(dtype: torch.dtype) -> None:
    # products 2 * 2 = 4 -> capped at 3, 0.5 * 1 = 0.5
    loss, metrics, grad = _corrected(
        [[2.0, 2.0], [0.5, 1.0]],
        OffPolicyCorrectionConfig("sequence", sequence_tis_ratio_clip_high=3.0),
        dtype,
    )
    close(loss, [[-3.0, -3.0], [-0.5, -0.5]], ops=6)
    close(grad, [[-3.0, -3.0], [-0.5, -0.5]], ops=6)  # the weight is a constant
    assert metrics["tis_seq_clip_frac"] == 0.5
    assert metrics["tis_seq_weight_mean"] == pytest.approx(1.75, rel=tol(dtype, 6))


def test_token_tis_through_the_group_equals_tis_imp_ratio_cap() -> None:
    w = [[3.0, 0.5]]
    by_group, m1, _ = _corrected(w, OffPolicyCorrectionConfig("token", token_tis_ratio_clip_high=2.0))
    close(by_group, [[-2.0, -0.5]], ops=4)
    assert m1["tis_clip_frac"] == 0.5
    by_cap, m2, _ = _corrected(w, OffPolicyCorrectionConfig(), use_tis=True, tis_imp_ratio_cap=2.0)
    assert torch.equal(by_group, by_cap) and m1 == m2
    with pytest.raises(ConfigError, match="both ask for truncated importance sampling"):
        load_config(
            [
                f"{A}.use_tis=true",
                f"{A}.tis_imp_ratio_cap=2.0",
                f"{A}.off_policy_correction.tis_ratio_type=token",
            ]
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_geometric_and_product_sequence_masks(dtype: torch.dtype) -> None:
    # geometric means: 1.02 (> 1.01, dropped), sqrt(0.99) = 0.995 (kept), sqrt(0.9) = 0.949 (< 0.99)
    w = [[1.02, 1.02], [1.0, 0.99], [0.9, 1.0]]
    loss, metrics, grad = _corrected(w, OffPolicyCorrectionConfig(sequence_mask_metric="geometric"), dtype)
    close(loss, [[0.0, 0.0], [-1.0, -1.0], [0.0, 0.0]], ops=2)
    close(grad, [[0.0, 0.0], [-1.0, -1.0], [0.0, 0.0]], ops=2)
    assert metrics["seq_mask_frac"] == pytest.approx(2 / 3)
    assert metrics["seq_mask_over_high_frac"] == pytest.approx(1 / 3)
    assert metrics["seq_mask_under_low_frac"] == pytest.approx(1 / 3)
    # products: 3 (> 2, dropped), 0.72 (kept), 0.25 (< 0.5, dropped)
    w = [[2.0, 1.5], [0.8, 0.9], [0.5, 0.5]]
    loss, metrics, _ = _corrected(w, OffPolicyCorrectionConfig(sequence_mask_metric="product"), dtype)
    close(loss, [[0.0, 0.0], [-1.0, -1.0], [0.0, 0.0]], ops=2)


def test_outlier_and_token_masks_and_their_order() -> None:
    # outlier bounds (0.1, 10): a token at 20 or at 0.05 drops its whole sequence
    w = [[20.0, 1.0], [1.0, 0.05], [5.0, 0.2]]
    c = OffPolicyCorrectionConfig(outlier_token_is_threshold_low=0.1, outlier_token_is_threshold_high=10.0)
    loss, metrics, _ = _corrected(w, c)
    close(loss, [[0.0, 0.0], [0.0, 0.0], [-1.0, -1.0]], ops=2)
    assert metrics["outlier_seq_masked_frac"] == pytest.approx(2 / 3)
    # token mask [0.5, 2]: only the tokens outside go
    loss, metrics, _ = _corrected(
        [[0.4, 1.0, 2.5]],
        OffPolicyCorrectionConfig(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0),
    )
    close(loss, [[0.0, -1.0, 0.0]], ops=2)
    assert metrics["token_mask_frac"] == pytest.approx(2 / 3)
    # the geometric mean is taken over the tokens the token mask kept: sqrt(5) alone would drop the
    # sequence, the kept token's 1.0 does not
    both = OffPolicyCorrectionConfig(
        sequence_mask_metric="geometric", token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0
    )
    loss, _, _ = _corrected([[1.0, 5.0]], both)
    close(loss, [[-1.0, 0.0]], ops=2)
    loss, _, _ = _corrected([[1.0, 5.0]], OffPolicyCorrectionConfig(sequence_mask_metric="geometric"))
    close(loss, [[0.0, 0.0]], ops=2)


def test_corrections_need_the_rollout_logprobs_and_sane_bounds() -> None:
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="an off-policy correction needs the rollout engine's logprobs"):
        compute_policy_loss(
            "regular",
            t,
            t,
            t,
            torch.ones(1, 2),
            AlgorithmConfig(off_policy_correction=OffPolicyCorrectionConfig("sequence")),
        )
    q = f"{A}.off_policy_correction"
    with pytest.raises(
        ConfigError,
        match=rf"{q}\.token_mask_is_threshold_low and token_mask_is_threshold_high must be set together",
    ):
        load_config([f"{q}.token_mask_is_threshold_low=0.5"])
    with pytest.raises(ConfigError, match=rf"{q}\.geo_mask_low=1.1 must be <= {q}\.geo_mask_high=1.01"):
        load_config([f"{q}.geo_mask_low=1.1"])
    with pytest.raises(ConfigError, match=rf"{q}\.tis_ratio_type='tokens' is not one of token, sequence"):
        load_config([f"{q}.tis_ratio_type=tokens"])
