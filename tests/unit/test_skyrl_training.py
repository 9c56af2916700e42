"""SkyRL's losses and corrections wired end to end (config -> loop -> objective), and policy
mini-batches that do not split evenly over the workers (padded as SkyRL pads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rl_fakes import FakePolicy, decode, fake_run
from tolerances import assert_gradients_close

from skylift.algorithms import mini_batch_totals
from skylift.rl.objective import PolicyObjective
from skylift.rl.update import UpdateSettings, pad_rows, train_policy
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.training_worker import TrainingWorker, WorkerSettings


@dataclass
class LossPolicy(FakePolicy):
    """Trains with the loop's objective: the trainer's logprobs are the rollout's plus 0.1 per
    sample index (sample 1 is off by exp(0.1) = 1.105 per token)."""

    losses: list[float] = field(default_factory=list)

    def train_mini_batch(
        self, batch: SequenceBatch, objective: Any, micro_batch_size: int, temperature: float
    ) -> dict[str, float]:
        super().train_mini_batch(batch, objective, micro_batch_size, temperature)
        shift = torch.tensor([0.1 * sample for _, sample, _ in decode(batch)]).unsqueeze(-1)
        logp = (batch.extras["rollout_logprobs"] + shift * batch.response_mask).requires_grad_(True)
        loss, metrics = objective(logp, batch)
        loss.backward()
        self.losses.append(float(loss.detach()))
        return metrics


def test_sapo_maxrl_and_a_geometric_mask_train_through_the_loop(tmp_path: Path) -> None:
    policy = LossPolicy()
    run = fake_run(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.algorithm.advantage_estimator=maxrl",
        "trainer.algorithm.policy_loss_type=sapo",
        "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
        policy=policy,
    )
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert len(history) == 2 and len(policy.losses) == 2
    # groups of 2 samples with rewards 0 and 1: maxrl gives (0 - 0.5) / (0.5 + 1e-6) to sample 0,
    # whose tokens sapo gates at r = 1 with tau_neg: -A * (4 / 1.05) * sigmoid(0); sample 1 (ratio
    # 1.105 to its rollout, geometric mean > 1.01) is masked. Half the tokens: token_mean halves it.
    per_token = 0.5 / (0.5 + 1e-6) * 4 / 1.05 * 0.5
    # float32: about 8 rounded operations per token (advantage, gate) and a mean over 32 tokens
    # (a sum of 16 equal terms): within 64 ulps
    eps32 = torch.finfo(torch.float32).eps
    for h, loss in zip(history, policy.losses, strict=True):
        assert math.isclose(h["policy/policy_loss"], per_token / 2, rel_tol=64 * eps32)
        assert math.isclose(loss, per_token / 2, rel_tol=64 * eps32)
        assert h["policy/seq_mask_frac"] == 0.5 and h["policy/seq_mask_over_high_frac"] == 0.5


def _rows(n: int, seed: int = 0) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(5, 400, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    responses = [
        torch.randint(5, 400, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    advantages = torch.randn(n, 1, generator=gen).expand(-1, batch.response_len) * batch.response_mask
    return batch.with_extras(advantages=advantages.contiguous())


def test_pad_rows_adds_rows_without_loss_up_to_a_multiple() -> None:
    batch = _rows(5)
    padded = pad_rows(batch, 4)
    assert padded.batch_size == 8
    assert torch.equal(padded.input_ids[5:], padded.input_ids[4:5].expand(3, -1))
    assert padded.response_mask[5:].sum() == 0 and torch.equal(padded.response_mask[:5], batch.response_mask)
    assert mini_batch_totals(padded.response_mask) == mini_batch_totals(batch.response_mask)
    assert pad_rows(batch, 5) is batch and pad_rows(batch, 1) is batch


@dataclass
class ShardRecorder:
    """A policy group of 8 workers that records what each mini-batch holds."""

    world_size: int = 8
    seen: list[tuple[int, int, float]] = field(default_factory=list)  # rows, rows with loss, tokens

    def train_mini_batch(
        self, batch: SequenceBatch, loss_fn: Any, micro_batch_size: int, temperature: Any
    ) -> dict[str, float]:
        with_loss = int((batch.response_mask.sum(-1) > 0).sum())
        self.seen.append((batch.batch_size, with_loss, loss_fn.token_count))
        return {"policy_loss": 0.0}


def test_a_mini_batch_of_20_sequences_over_8_workers_trains_as_skyrl_does() -> None:
    """SkyRL's livecodebench example: 4 prompts x 5 samples per mini-batch, 8 workers. Each
    mini-batch holds its 20 sequences plus 4 rows without loss (3 rows per worker), and the loss is
    normalised by the 20 sequences' tokens."""
    batch = _rows(80, seed=1)
    policy = ShardRecorder()
    settings = UpdateSettings(rows_per_mini_batch=20, critic_rows_per_mini_batch=20)
    metrics = train_policy(policy, batch, PolicyObjective(), settings)
    tokens = [float(batch.response_mask[i : i + 20].sum()) for i in range(0, 80, 20)]
    assert policy.seen == [(24, 20, t) for t in tokens]
    assert metrics["train/rows_trained_frac"] == 1.0


def test_padding_rows_add_nothing_to_the_gradient(tiny_model_dir: Path) -> None:
    batch = _rows(5, seed=2)
    totals = mini_batch_totals(batch.response_mask)
    objective = PolicyObjective(token_count=totals.token_count, seq_count=totals.seq_count)
    grads = []
    for rows in (batch, pad_rows(batch, 8)):
        w = TrainingWorker(WorkerSettings(model_path=str(tiny_model_dir)))
        w.setup()
        w.accumulate_gradients(rows, objective, micro_batch_size=2)
        grads.append({n: p.grad.clone() for n, p in w.model.named_parameters()})
    assert_gradients_close(grads[1], grads[0], int(batch.attention_mask.sum()))
    assert any(g.abs().sum() > 0 for g in grads[0].values())
