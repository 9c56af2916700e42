"""Loss reductions by hand, and micro-batch gradient accumulation == one big batch."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_sums_close, sum_tolerance
from torch import nn

from skylift.algorithms import (
    LOSS_REDUCTIONS,
    compute_advantages,
    compute_kl,
    compute_policy_loss,
    mini_batch_totals,
    reduce_loss,
    sequence_rewards_to_token_level,
)
from skylift.config.algorithm import AlgorithmConfig

NAN = float("nan")
# Three sequences: lengths 3, 2 and 0 (fully masked); masked positions hold garbage (NaN).
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, NAN, NAN], [NAN, NAN, NAN, NAN]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_mini_batch_totals() -> None:
    # 5 valid tokens; 2 sequences with at least one valid token (row 2 is fully masked)
    assert mini_batch_totals(MASK) == (5, 2)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 3.0),  # (1 + 2 + 3 + 4 + 5) / 5
        ("sequence_mean", 3.25),  # (6/3 + 9/2) / 2 = (2 + 4.5) / 2; the empty row does not count
        ("seq_mean_token_sum_norm", 1.875),  # (6/4 + 9/4) / 2 = 15/8 with max_len 4
    ],
)
def test_reduce_loss_by_hand(mode: str, expected: float) -> None:
    assert reduce_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_reduce_loss_micro_batches_sum_to_whole() -> None:
    totals = mini_batch_totals(MASK)
    for mode in LOSS_REDUCTIONS:
        whole = reduce_loss(LOSS, MASK, mode, max_len=4)
        parts = [
            reduce_loss(
                LOSS[i : i + 1, :width],
                MASK[i : i + 1, :width],
                mode,
                global_token_count=totals.token_count,
                global_seq_count=totals.seq_count,
                max_len=4,
            )
            for i, width in ((0, 3), (1, 2), (2, 1))  # each micro-batch padded to its own length
        ]
        # e.g. token_mean: 6/5 + 9/5 + 0 = 3.0
        assert sum(p.item() for p in parts) == pytest.approx(whole.item()), mode


def test_seq_mean_token_sum_norm_uses_max_len_not_padding() -> None:
    # 6 / 10 for the first sequence, 9 / 10 for the second -> mean 0.75
    assert reduce_loss(LOSS, MASK, "seq_mean_token_sum_norm", max_len=10).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="needs max_len"):
        reduce_loss(LOSS, MASK, "seq_mean_token_sum_norm", global_token_count=5, global_seq_count=2)


def test_all_masked_batch_reduces_to_zero_with_zero_grad() -> None:
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in LOSS_REDUCTIONS:
        out = reduce_loss(loss, torch.zeros(2, 3), mode)
        assert out.item() == 0.0, mode
        out.backward()
        assert torch.equal(loss.grad, torch.zeros(2, 3)), mode
        loss.grad = None


def test_reduce_loss_errors_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown loss reduction 'mean'; known: token_mean, sequence_mean"):
        reduce_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match=r"loss_mask shape \(3, 3\) != per_token_loss shape \(3, 4\)"):
        reduce_loss(LOSS, MASK[:, :3], "token_mean")


# --- micro-batch equivalence on a tiny model -------------------------------------------------------

VOCAB, DIM, MAX_LEN = 13, 6, 8
LENGTHS = [5, 2, 8, 3, 1, 6, 4, 0]  # 8 sequences; the last one is fully masked
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
MICRO = 2  # 4 micro-batches of 2 sequences


class TinyPolicy(nn.Module):
    """Embedding + linear: a next-token distribution conditioned on the previous token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def token_logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(inputs)))
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def make_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    policy = TinyPolicy()
    old_policy = copy.deepcopy(policy)
    ref_policy = copy.deepcopy(policy)
    with torch.no_grad():  # make the old and reference policies differ so ratios leave the clip range
        for p_old, p_ref in zip(old_policy.parameters(), ref_policy.parameters(), strict=True):
            p_old.add_(torch.randn(p_old.shape, generator=gen) * 0.5)
            p_ref.add_(torch.randn(p_ref.shape, generator=gen) * 0.3)
    inputs = torch.randint(0, VOCAB, (len(LENGTHS), MAX_LEN), generator=gen)
    targets = torch.randint(0, VOCAB, (len(LENGTHS), MAX_LEN), generator=gen)
    mask = (torch.arange(MAX_LEN).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).float()
    with torch.no_grad():
        old = old_policy.token_logprobs(inputs, targets)
        ref = ref_policy.token_logprobs(inputs, targets)
        rollout = old + torch.randn(old.shape, generator=gen) * 0.3
    rewards = sequence_rewards_to_token_level(torch.rand(len(LENGTHS), generator=gen), mask)
    advantages, _ = compute_advantages("grpo", rewards, mask, group_ids=GROUPS)
    return {
        "policy": policy,
        "inputs": inputs,
        "targets": targets,
        "mask": mask,
        "old": old,
        "ref": ref,
        "rollout": rollout,
        "advantages": advantages,
    }


def loss_of(
    policy: TinyPolicy,
    batch: dict[str, torch.Tensor],
    rows: slice,
    loss_name: str,
    mode: str,
    config: AlgorithmConfig,
    kl_coef: float,
    absolute: bool = False,
    **totals: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of the sequences `rows`, trimmed to their own longest length (micro-batch padding);
    `absolute`: of the per-token losses' absolute values (the sum|terms| of the loss)."""
    mask = batch["mask"][rows]
    width = max(int(mask.sum(-1).max().item()), 1)
    sl = (rows, slice(0, width))
    mask = mask[:, :width]
    logp = policy.token_logprobs(batch["inputs"][sl], batch["targets"][sl])
    per_token, metrics = compute_policy_loss(
        loss_name,
        logp,
        batch["old"][sl],
        batch["advantages"][sl],
        mask,
        config,
        rollout_logprobs=batch["rollout"][sl],
    )
    if kl_coef:
        per_token = per_token + kl_coef * compute_kl(logp, batch["ref"][sl], "k3")
    if absolute:
        per_token = per_token.abs()
    return reduce_loss(per_token, mask, mode, max_len=MAX_LEN, **totals), metrics


def grads(policy: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in policy.parameters()]


CASES = [
    ("regular", AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28), 0.0),
    ("dual_clip", AlgorithmConfig(clip_ratio_c=1.5, use_tis=True, tis_imp_ratio_cap=1.2), 0.0),
    ("gspo", AlgorithmConfig(eps_clip_low=0.1, eps_clip_high=0.1), 0.1),
    ("cispo", AlgorithmConfig(eps_clip_low=0.5, eps_clip_high=0.2), 0.1),
]


@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
@pytest.mark.parametrize(("loss_name", "config", "kl_coef"), CASES, ids=[c[0] for c in CASES])
def test_micro_batches_give_the_mini_batch_gradient(
    mode: str, loss_name: str, config: AlgorithmConfig, kl_coef: float
) -> None:
    batch = make_batch()
    policy = batch["policy"]
    n = len(LENGTHS)

    policy.zero_grad()
    whole, metrics = loss_of(policy, batch, slice(0, n), loss_name, mode, config, kl_coef)
    whole.backward()
    expected = grads(policy)
    # the case must exercise clipping, or the test would not check the interesting branch
    assert 0.0 < metrics["clip_frac"] < 1.0, metrics

    totals = mini_batch_totals(batch["mask"])
    policy.zero_grad()
    accumulated = 0.0
    for start in range(0, n, MICRO):
        micro, _ = loss_of(
            policy,
            batch,
            slice(start, start + MICRO),
            loss_name,
            mode,
            config,
            kl_coef,
            global_token_count=totals.token_count,
            global_seq_count=totals.seq_count,
        )
        micro.backward()
        accumulated += micro.item()
    tokens = int(batch["mask"].sum())  # the loss and each gradient sum one term per valid token
    with torch.no_grad():
        terms = loss_of(policy, batch, slice(0, n), loss_name, mode, config, kl_coef, absolute=True)[0]
    assert abs(accumulated - whole.item()) <= sum_tolerance(terms.item(), tokens)
    for got, want in zip(grads(policy), expected, strict=True):
        assert want.abs().max() > 1e-4  # a real gradient, not all zeros
        assert_sums_close(got, want, tokens)


@pytest.mark.parametrize("mode", LOSS_REDUCTIONS)
def test_naive_micro_batch_means_give_a_different_gradient(mode: str) -> None:
    """Control: averaging each micro-batch by its own counts (and 1/num_micro) is not equivalent."""
    batch = make_batch()
    policy = batch["policy"]
    n = len(LENGTHS)
    config = AlgorithmConfig()

    policy.zero_grad()
    loss_of(policy, batch, slice(0, n), "regular", mode, config, 0.0)[0].backward()
    expected = grads(policy)

    policy.zero_grad()
    for start in range(0, n, MICRO):
        micro, _ = loss_of(policy, batch, slice(start, start + MICRO), "regular", mode, config, 0.0)
        (micro / (n // MICRO)).backward()
    diff = max((g - w).abs().max().item() for g, w in zip(grads(policy), expected, strict=True))
    assert diff > 1e-4
