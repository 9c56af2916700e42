"""Sampling-support replay (skylift.algorithms.sample_support): the trainer scores tokens under the
truncated, renormalised distribution vLLM sampled them from, on every forward path.

The reference (vllm_sampler_reference.py) transcribes vLLM's sampler one row at a time; the batched
code must agree with it, ties included. tests/integration/test_server_sample_support.py checks both
against vLLM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from vllm_sampler_reference import NEG_INF, reference_logprobs

from skylift.algorithms import mini_batch_totals
from skylift.algorithms.sample_support import (
    TokenDistribution,
    logprobs_with_full,
    support_mask,
    token_logprobs,
)
from skylift.config import load_config
from skylift.config.algorithm import AlgorithmConfig
from skylift.rl.objective import PolicyObjective
from skylift.rl.sampling import sampling_params
from skylift.rl.update import UpdateSettings
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.logprobs import response_logprobs
from skylift.worker.micro_batches import packed_response_logprobs
from skylift.worker.prefix_tree import prefix_tree_response_logprobs

DISTRIBUTIONS = [
    TokenDistribution(temperature=0.7, top_p=0.7),
    TokenDistribution(top_k=5),
    TokenDistribution(temperature=1.3, min_p=0.2),
    TokenDistribution(temperature=0.9, top_k=20, top_p=0.7, min_p=0.05),
    TokenDistribution(top_k=3, top_p=0.5),
]


@pytest.mark.parametrize(
    "dist", DISTRIBUTIONS, ids=lambda d: f"T{d.temperature}k{d.top_k}p{d.top_p}m{d.min_p}"
)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_matches_the_reference_on_random_logits(dist: TokenDistribution, ties: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 2
    if ties:  # few distinct values: ties at the top-k, top-p and min-p edges
        logits = torch.randint(0, 6, (64, 50), generator=gen).float()
    reference = torch.stack([reference_logprobs(row, dist) for row in logits])
    assert (support_mask(logits / dist.temperature, dist) == (reference > NEG_INF)).all()
    # the sampled tokens: drawn from the reference distribution, so inside its support
    targets = torch.multinomial(reference.exp(), 1, generator=gen).squeeze(-1)
    got = token_logprobs(logits, targets, dist)
    want = reference.gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    # K tokens per position: those outside the support get -inf
    several = token_logprobs(logits, torch.arange(50).expand(64, 50), dist)
    assert torch.equal(several == NEG_INF, reference == NEG_INF)
    finite = reference > NEG_INF
    assert torch.allclose(several[finite], reference[finite], atol=1e-6)
    if ties and dist.top_k > 0 and dist.top_p == 1:  # more than k tie with the k-th somewhere: all stay
        assert (finite.sum(-1) > dist.top_k).any()


def test_without_truncation_it_is_the_tempered_log_softmax() -> None:
    logits = torch.randn(4, 7, 30)
    targets = torch.randint(0, 30, (4, 7))
    want = (logits / 0.8).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets, 0.8), want, atol=1e-6)
    assert torch.allclose(token_logprobs(logits, targets, TokenDistribution(0.8)), want, atol=1e-6)
    pair = logprobs_with_full(logits, targets, TokenDistribution(0.8, top_k=3))
    assert pair.shape == (4, 7, 2)
    assert torch.allclose(pair[..., 1], want, atol=1e-6)
    assert (pair[..., 0] >= pair[..., 1] - 1e-6).all()  # renormalised over fewer tokens


def test_no_gradient_outside_the_support() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(32, 40, generator=gen) * 2).requires_grad_(True)
    dist = TokenDistribution(temperature=0.8, top_k=10, top_p=0.8, min_p=0.02)
    keep = support_mask(logits.detach() / 0.8, dist)
    probs = torch.where(keep, (logits.detach() / 0.8).masked_fill(~keep, NEG_INF).softmax(-1), 0.0)
    targets = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    weights = torch.randn(32, generator=gen)
    (token_logprobs(logits, targets, dist) * weights).sum().backward()
    assert logits.grad is not None
    assert (logits.grad[~keep] == 0).all()
    several = keep.sum(-1) > 1  # (a one-token support gives logprob 0 whatever the logits)
    assert several.sum() > 16 and (logits.grad[several][keep[several]].abs() > 0).all()
    # the probabilities over the support sum to one (every token scored at once: no token joins)
    every = token_logprobs(logits.detach(), torch.arange(40).expand(32, 40), dist)
    assert torch.allclose(every.exp().sum(-1), torch.ones(32), atol=1e-5)
    assert torch.equal(every > NEG_INF, keep)


def test_a_sampled_token_outside_the_recomputed_support_joins_it() -> None:
    """The engine's logits differ from the trainer's by round-off: a token the engine kept at the
    edge may fall just outside the trainer's support. It is scored as if inside (finite, with
    gradient), the support's mass renormalised with it."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]], requires_grad=True)
    dist = TokenDistribution(top_k=2)
    got = token_logprobs(logits, torch.tensor([2]), dist)
    want = 2.0 - torch.logsumexp(torch.tensor([4.0, 3.0, 2.0]), 0)
    assert torch.allclose(got, want.reshape(1))
    got.sum().backward()
    assert logits.grad is not None
    assert logits.grad[0, 3] == 0 and (logits.grad[0, :3] != 0).all()


def test_bad_distributions_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TokenDistribution(temperature=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        TokenDistribution(top_p=0.0)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        TokenDistribution(min_p=1.5)
    assert not TokenDistribution(top_k=-1).truncates and not TokenDistribution(top_k=0).truncates


def test_config_turns_replay_on_whenever_sampling_truncates() -> None:
    def dist(*overrides: str) -> TokenDistribution:
        cfg = load_config(list(overrides))
        return UpdateSettings.from_config(cfg, sampling_params(cfg, False)).temperature

    sp = "generator.sampling_params"
    key = "trainer.algorithm.enable_sample_support_replay"
    assert dist() == TokenDistribution()
    assert dist(f"{sp}.temperature=0.7") == TokenDistribution(0.7)
    truncated = [f"{sp}.top_p=0.7", f"{sp}.top_k=20", f"{sp}.min_p=0.05"]
    assert dist(*truncated) == TokenDistribution(1.0, top_k=20, top_p=0.7, min_p=0.05)  # null = auto
    assert dist(*truncated, f"{key}=true") == TokenDistribution(1.0, top_k=20, top_p=0.7, min_p=0.05)
    assert dist(*truncated, f"{key}=false") == TokenDistribution(1.0)  # the old, biased scoring
    assert dist(*truncated, f"{sp}.temperature=0") == TokenDistribution()  # greedy: no truncation


# ------------------------------------------------------------------ the model's forward paths


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _group_batch(seed: int = 0) -> SequenceBatch:
    """Three prompts sharing a prefix, four responses each (one repeated), with advantages."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(5, 1000, (5,), generator=gen).tolist()
    prompts, responses = [], []
    for _ in range(3):
        prompt = system + torch.randint(5, 1000, (int(torch.randint(1, 5, (1,), generator=gen)),)).tolist()
        for j in range(4):
            n = int(torch.randint(1, 7, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(
                responses[-1] if j == 3 else torch.randint(5, 1000, (n,), generator=gen).tolist()
            )
    batch = build_sequence_batch(prompts, responses)
    advantages = torch.randn(len(responses), 1, generator=gen).expand(-1, batch.response_len)
    return batch.with_extras(advantages=(advantages * batch.response_mask).contiguous())


PATHS = {
    "padded": lambda m, b, d, full=False: response_logprobs(m, b, d, share_prompts=False, with_full=full),
    "shared-prompt": lambda m, b, d, full=False: response_logprobs(m, b, d, with_full=full),
    "packed": lambda m, b, d, full=False: packed_response_logprobs(m, b, d, full),
    "prefix-shared": lambda m, b, d, full=False: prefix_tree_response_logprobs(m, b, d, full),
}
# near-uniform logits of the untrained tiny model: top-k and top-p decide the support
DIST = TokenDistribution(temperature=0.9, top_k=20, top_p=0.7, min_p=0.05)


def test_padded_packed_and_prefix_shared_agree(tiny_lm: torch.nn.Module) -> None:
    batch = _group_batch()
    tiny_lm.eval()
    with torch.no_grad():
        full = (
            tiny_lm(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        ).logits
    scored = full[:, batch.prompt_len - 1 : -1]  # the logits that predict each response token
    want = torch.stack(
        [
            torch.stack(
                [
                    reference_logprobs(scored[i, t], DIST)[batch.response_ids[i, t]]
                    for t in range(scored.shape[1])
                ]
            )
            for i in range(batch.batch_size)
        ]
    )
    want = want * batch.response_mask
    mask = batch.response_mask.bool()
    for name, path in PATHS.items():
        with torch.no_grad():
            got = path(tiny_lm, batch, DIST) * batch.response_mask
            pair = path(tiny_lm, batch, DIST, True)
        # the response tokens are random: some lie outside the support and join it (finite)
        assert torch.isfinite(got).all(), name
        inside = mask & torch.isfinite(want)
        assert torch.allclose(got[inside], want[inside], atol=1e-5), (name, (got - want)[inside].abs().max())
        assert torch.allclose(pair[..., 0] * batch.response_mask, got, atol=1e-6), name
        untruncated = path(tiny_lm, batch, DIST.full()) * batch.response_mask
        assert torch.allclose(pair[..., 1] * batch.response_mask, untruncated, atol=1e-6), name


def _logit_grads(model: torch.nn.Module, run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, their gradient) of every lm_head output during `run()` (a forward and backward)."""
    outputs: list[torch.Tensor] = []

    def keep(_module, _inputs, output):
        output.retain_grad()
        outputs.append(output)

    handle = model.get_output_embeddings().register_forward_hook(keep)
    try:
        run()
    finally:
        handle.remove()
    return [(o.detach(), o.grad) for o in outputs]


@pytest.mark.parametrize("path", ["padded", "packed", "prefix-shared"])
def test_a_grpo_step_has_no_gradient_outside_the_support(tiny_lm: torch.nn.Module, path: str) -> None:
    """The policy loss's gradient reaches the logits of supported tokens (and of the sampled one)
    only: every other logit at a scored position gets exactly zero."""
    batch = _group_batch(seed=3)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    tiny_lm.train()
    tiny_lm.zero_grad()

    def step() -> None:
        logp = PATHS[path](tiny_lm, batch, DIST)
        loss, _ = objective(logp, batch)
        loss.backward()

    [(logits, grad)] = _logit_grads(tiny_lm, step)
    assert grad is not None
    flat_logits, flat_grad = logits.reshape(-1, logits.shape[-1]), grad.reshape(-1, grad.shape[-1])
    scored = flat_grad.abs().sum(-1) > 0  # positions whose logits the loss reads
    keep = support_mask(flat_logits / DIST.temperature, DIST)
    outside = ~keep[scored]
    assert int(scored.sum()) > 0 and int(outside.sum(-1).min()) > 900  # ~1000 of 1024 tokens cut
    # zero gradient outside the support but for sampled tokens that joined it (prefix sharing
    # scores up to a group's 4 first response tokens at one position)
    nonzero_outside = (flat_grad[scored] != 0) & outside
    assert int(nonzero_outside.sum(-1).max()) <= (4 if path == "prefix-shared" else 1)
    sampled = set(batch.response_ids[batch.response_mask.bool()].tolist())
    assert set(nonzero_outside.nonzero()[:, 1].tolist()) <= sampled
    tiny_lm.eval()


def test_the_kl_loss_reads_the_untruncated_logprobs() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    full = torch.tensor([[-3.0, -4.0]])
    batch = build_sequence_batch([[1]], [[2, 3]]).with_extras(
        advantages=torch.zeros(1, 2), ref_logprobs=full.clone(), full_logprobs=full
    )
    objective = PolicyObjective(
        AlgorithmConfig(use_kl_loss=True, kl_loss_coef=1.0), token_count=2.0, seq_count=1.0
    )
    assert objective.needs_full_logprobs and not PolicyObjective().needs_full_logprobs
    _, metrics = objective(logprobs, batch)
    assert metrics["kl_loss"] == 0.0  # full == ref: no KL, although the truncated logprobs differ
    _, metrics = objective(logprobs, batch.with_extras(full_logprobs=logprobs))
    assert metrics["kl_loss"] > 0


def test_a_lora_worker_scores_and_trains_under_the_distribution(
    tiny_model_dir: Path, tiny_lm: torch.nn.Module, tmp_path: Path
) -> None:
    """A LoRA worker (its adapter starts at zero: the base model's logits) gives the truncated
    logprobs, a KL loss trains against the untruncated ones (the worker hands them to the
    objective), and the policy loss gives no gradient outside the support."""
    from skylift.config.schema import OptimizerConfig
    from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

    batch = _group_batch(seed=5)
    tiny_lm.eval()
    with torch.no_grad():
        want = response_logprobs(tiny_lm, batch, DIST) * batch.response_mask
        untruncated = response_logprobs(tiny_lm, batch, DIST.full()) * batch.response_mask
    worker = TrainingWorker(
        WorkerSettings(
            model_path=str(tiny_model_dir),
            optimizer=OptimizerSettings(OptimizerConfig(lr=1e-3, weight_decay=0.0)),
            lora_rank=4,
        ),
        init_method=f"file://{tmp_path / 'rdzv'}",
    )
    worker.setup()
    try:
        got = worker.compute_logprobs(batch, micro_batch_size=4, temperature=DIST)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        totals = mini_batch_totals(batch.response_mask)
        objective = dataclasses.replace(
            PolicyObjective(AlgorithmConfig(use_kl_loss=True, kl_loss_coef=1.0)),
            token_count=totals.token_count,
            seq_count=totals.seq_count,
        )
        batch = batch.with_extras(ref_logprobs=untruncated, old_logprobs=got)
        worker.zero_grad()
        metrics = worker.accumulate_gradients(batch, objective, micro_batch_size=4, temperature=DIST)
        assert abs(metrics["kl_loss"]) < 1e-6  # policy == reference on the untruncated distribution
        # the policy loss alone (the KL reads the untruncated distribution by design) gives no
        # gradient to logits outside the support, but for sampled tokens that joined it
        policy_only = dataclasses.replace(objective, algorithm=AlgorithmConfig())
        worker.zero_grad()
        grads = _logit_grads(worker.model, lambda: worker.accumulate_gradients(batch, policy_only, 4, DIST))
        sampled = set(batch.response_ids[batch.response_mask.bool()].tolist())
        reached = 0
        for logits, grad in grads:
            flat_logits, flat_grad = logits.reshape(-1, logits.shape[-1]), grad.reshape(-1, grad.shape[-1])
            scored = flat_grad.abs().sum(-1) > 0
            reached += int(scored.sum())
            outside = ~support_mask(flat_logits[scored] / DIST.temperature, DIST)
            nonzero_outside = (flat_grad[scored] != 0) & outside
            assert int(outside.sum(-1).min()) > 900
            # (the worker shares each prompt's forward pass: its last position scores the first
            # token of the group's 4 responses)
            assert int(nonzero_outside.sum(-1).max()) <= 4
            assert set(nonzero_outside.nonzero()[:, 1].tolist()) <= sampled
        assert reached > 20  # of 46 response tokens (shared prompt positions count once)
    finally:
        worker.shutdown()


def test_the_kl_in_the_reward_reads_the_policys_untruncated_logprobs() -> None:
    from skylift.config.algorithm import AlgorithmConfig
    from skylift.generator import Trajectory
    from skylift.rl.experience import ExperienceStages, make_experience
    from skylift.rl.staleness import StalenessPolicy

    trajectories = [
        Trajectory("a", [7], [1, 2], [1, 1], [-0.5, -0.5], reward=r, stop_reason="stop") for r in (1.0, 0.0)
    ]
    truncated = torch.full((2, 2), -0.5)  # old logprobs under the truncated distribution
    untruncated = torch.full((2, 2), -2.0)
    settings = ExperienceStages.of(
        AlgorithmConfig(use_kl_in_reward=True, kl_loss_coef=0.1, kl_estimator_type="k1"),
        StalenessPolicy(old_logprobs="trainer"),
    )

    def kl(**fns) -> float:
        exp = make_experience(trajectories, settings, 0, policy_logprobs=lambda b: truncated, **fns)
        assert torch.equal(exp.batch.extras["old_logprobs"], truncated)  # the PPO anchor stays truncated
        return exp.metrics["kl_in_reward/kl"]

    assert kl(ref_logprobs=lambda b: untruncated, full_policy_logprobs=lambda b: untruncated) == 0.0
    assert kl(ref_logprobs=lambda b: untruncated) == pytest.approx(1.5)  # truncated vs untruncated
