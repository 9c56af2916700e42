"""The Tinker losses against values computed by hand, and provenance resolution for stable_reinforce."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skylift.tinker.core.provenance import Span, StabilityRecords
from skylift.tinker.errors import UserError
from skylift.tinker.training.losses import RECORDED_LOGPROBS, SAMPLED_MASK, check_config, get_loss

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def _run(name: str, logp: list[float], config: dict | None = None, **inputs: list[float]):
    lp = torch.tensor([logp], requires_grad=True)
    tensors = {k: torch.tensor([v]) for k, v in inputs.items()}
    per_token, metrics = get_loss(name).impl(lp, tensors, MASK, config or {})
    return lp, per_token, metrics


def test_dro_is_the_documented_objective() -> None:
    # -(logp * A - beta/2 * (logp - q)^2) per token, beta 0.05 by default
    lp, per_token, _ = _run(
        "dro", [-1.0, -2.0, -0.5, 9.0], logprobs=[-1.5, -2.0, -1.0, 0.0], advantages=[1.0, -1.0, 2.0, 5.0]
    )
    expected = [-(-1.0 * 1.0 - 0.025 * 0.25), -(-2.0 * -1.0 - 0.0), -(-0.5 * 2.0 - 0.025 * 0.25), 0.0]
    assert per_token[0].tolist() == pytest.approx(expected)
    _, wider, _ = _run(
        "dro", [-1.0, -2.0, -0.5, 9.0], {"beta": 1.0}, logprobs=[-1.5, -2.0, -1.0, 0.0], advantages=[0.0] * 4
    )
    assert wider[0].tolist() == pytest.approx([0.125, 0.0, 0.125, 0.0])
    per_token.sum().backward()  # d/dlogp = -A + beta * (logp - q)
    assert lp.grad[0].tolist() == pytest.approx([-1.0 + 0.05 * 0.5, 1.0, -2.0 + 0.05 * 0.5, 0.0])


def test_gspo_uses_the_sequence_ratio_over_the_ratio_mask() -> None:
    # token log-ratios 0.1, 0.3 on the masked tokens: s = exp(0.2); the third token is outside the mask
    logp = [-1.0, -1.0, -1.0, 0.0]
    q = [-1.1, -1.3, -3.0, 0.0]
    lp, per_token, metrics = _run(
        "gspo", logp, logprobs=q, advantages=[1.0, 1.0, 1.0, 1.0], sequence_ratio_mask=[1.0, 1.0, 0.0, 0.0]
    )
    s = math.exp(0.2)  # 1.2214 > 1.2: clipped for a positive advantage
    assert per_token[0, :3].tolist() == pytest.approx([-1.2, -1.2, -1.2])
    assert per_token[0, 3].item() == 0.0
    assert metrics["sequence_ratio:mean"] == pytest.approx(s, rel=1e-5)
    _, inside, _ = _run(
        "gspo",
        logp,
        {"clip_high_threshold": 1.5},
        logprobs=q,
        advantages=[2.0, -1.0, 0.0, 0.0],
        sequence_ratio_mask=[1.0, 1.0, 0.0, 0.0],
    )
    assert inside[0].tolist() == pytest.approx([-2.0 * s, s, 0.0, 0.0], rel=1e-5)
    # the gradient is that of each token's own logprob, scaled by s * -A
    lp2 = torch.tensor([logp], requires_grad=True)
    out, _ = get_loss("gspo").impl(
        lp2,
        {
            "logprobs": torch.tensor([q]),
            "advantages": torch.tensor([[2.0, -1.0, 0.0, 0.0]]),
            "sequence_ratio_mask": torch.tensor([[1.0, 1.0, 0.0, 0.0]]),
        },
        MASK,
        {"clip_high_threshold": 1.5},
    )
    out.sum().backward()
    assert lp2.grad[0].tolist() == pytest.approx([-2.0 * s, s, 0.0, 0.0], rel=1e-5)


def test_stable_reinforce_weights_reinforce_by_the_recorded_ratio() -> None:
    # recorded sampler logprobs: ratios exp(0)=1, exp(1)=2.72 (clipped to 2), exp(-0.5)=0.61
    logp = [-1.0, -1.0, -1.0, 0.0]
    recorded = [-1.0, -2.0, -0.5, 0.0]
    inputs = {
        "logprobs": [0.0] * 4,  # the client's copy is not what the loss uses
        "advantages": [1.0, 1.0, -2.0, 0.0],
        RECORDED_LOGPROBS: recorded,
        SAMPLED_MASK: [1.0, 1.0, 1.0, 0.0],
    }
    lp, per_token, _ = _run("stable_reinforce", logp, **inputs)
    w = [1.0, 2.0, math.exp(-0.5)]
    assert per_token[0, :3].tolist() == pytest.approx([w[0] * 1.0, w[1] * 1.0, -w[2] * 2.0], rel=1e-5)
    per_token.sum().backward()
    assert lp.grad[0, :3].tolist() == pytest.approx([-w[0], -w[1], 2.0 * w[2]], rel=1e-5)
    _, with_kl, metrics = _run("stable_reinforce", logp, {"kl_coeff": 0.5}, **inputs)
    k3 = [0.0, math.exp(-1.0) + 1.0 - 1.0, math.exp(0.5) - 0.5 - 1.0]  # exp(q - p) - (q - p) - 1
    base = per_token[0, :3].detach()
    assert (with_kl[0, :3] - base).tolist() == pytest.approx([0.5 * k for k in k3], rel=1e-4)
    assert "kl:mean" in metrics


def test_cross_entropy_takes_two_d_targets() -> None:
    logp = torch.log(torch.tensor([[[0.5, 0.25], [0.1, 0.9], [1.0, 1.0], [1.0, 1.0]]]))
    weights = torch.tensor([[[1.0, 0.5], [0.0, 2.0], [0.0, 0.0], [7.0, 7.0]]])
    per_token, _ = get_loss("cross_entropy").impl(logp, {"weights": weights}, MASK, {})
    expected = [-(math.log(0.5) + 0.5 * math.log(0.25)), -2.0 * math.log(0.9), 0.0, 0.0]
    assert per_token[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_config_keys_a_loss_does_not_read_are_refused() -> None:
    check_config(get_loss("dro"), {"beta": 0.1})
    with pytest.raises(UserError, match="do not apply to loss 'cross_entropy'"):
        check_config(get_loss("cross_entropy"), {"beta": 0.1})
    with pytest.raises(UserError, match="forward_backward_custom"):
        get_loss("custom")


def test_provenance_resolves_recorded_logprobs_and_refuses_bad_claims() -> None:
    records = StabilityRecords()
    records.add("req:0", "s1", [7, 8, 9], [-0.1, -0.2, -0.3])
    spans = [Span(False, "req:0", 1, 2), Span(True, "req:0", 0, 3)]
    targets = np.array([3, 4, 7, 8, 9])
    advantages = np.array([0, 0, 1, 1, 1], dtype=np.float32)
    recorded, sampled = records.resolve(spans, targets, advantages, "s1", "datum 0")
    assert recorded.tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert sampled.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(UserError, match="not the tokens sampled"):
        records.resolve(spans, np.array([3, 4, 7, 8, 1]), advantages, "s1", "datum 0")
    with pytest.raises(UserError, match="only on sampled tokens"):
        records.resolve(spans, targets, np.array([0, 1, 1, 1, 1], dtype=np.float32), "s1", "datum 0")
    with pytest.raises(UserError, match="no stability record in this session"):
        records.resolve(spans, targets, advantages, "other-session", "datum 0")
    with pytest.raises(UserError, match="cover 4 positions, not 5"):
        records.resolve(spans[:1] + [Span(True, "req:0", 0, 2)], targets, advantages, "s1", "datum 0")


def test_records_are_bounded_in_tokens() -> None:
    records = StabilityRecords(max_tokens=5)
    records.add("a", "s", [1, 2, 3], [0.0] * 3)
    records.add("b", "s", [1, 2, 3], [0.0] * 3)
    assert len(records) == 1
    with pytest.raises(UserError):
        records.get("a", "s")
    assert records.get("b", "s").tokens.tolist() == [1, 2, 3]
