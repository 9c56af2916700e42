"""Prefix sharing (`trainer.share_prefixes`): every distinct prefix computed once, same numbers as
the padded passes (logprobs, critic values, policy gradients)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tolerances import assert_gradients_close, assert_sums_close

from skylift.algorithms import mini_batch_totals
from skylift.config.schema import OptimizerConfig
from skylift.models.tiny_qwen2 import INTERMEDIATE_SIZE, VOCAB_SIZE
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.logprobs import response_logprobs
from skylift.worker.prefix_tree import build_prefix_tree, prefix_tree_response_logprobs
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def _grpo_batch(vocab: int = 500, prompts: int = 3, group: int = 4, seed: int = 0) -> SequenceBatch:
    """GRPO rows whose prompts share a 'system message' and differ after it (different lengths),
    each answered `group` times; one response of every group is repeated (identical samples)."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(5, vocab, (6,), generator=gen).tolist()
    prompt_rows, responses = [], []
    for _ in range(prompts):
        question = torch.randint(5, vocab, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
        prompt = system + question.tolist()
        for j in range(group):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            prompt_rows.append(prompt)
            responses.append(
                responses[-1] if j == group - 1 else torch.randint(5, vocab, (n,), generator=gen).tolist()
            )
    batch = build_sequence_batch(prompt_rows, responses, pad_token_id=0)
    advantages = torch.randn(len(responses), 1, generator=gen).expand(-1, batch.response_len)
    return batch.with_extras(advantages=(advantages * batch.response_mask).contiguous())


def test_tree_holds_each_distinct_prefix_once() -> None:
    # prompts [1 2 3] and [1 2 4]; responses: [5 6] and [5 7] after the first, [5 6] after the second
    batch = build_sequence_batch([[1, 2, 3], [1, 2, 3], [1, 2, 4]], [[5, 6], [5, 7], [5, 6]])
    tree = build_prefix_tree(batch)
    # nodes in creation order: 1 2 3 5 6 | 7 (after 1 2 3 5) | 4 5 6 (after 1 2)
    assert tree.input_ids.tolist() == [[1, 2, 3, 5, 6, 7, 4, 5, 6]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 2, 3, 4]]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 3, 1, 6, 7]
    # response tokens are scored at the node before them: rows 0 and 1 share nodes 2 (-> 5) and 3
    assert tree.keep[tree.index].tolist() == [2, 3, 2, 3, 6, 7]
    assert tree.targets.tolist() == [5, 6, 5, 7, 5, 6]
    assert tree.keep.tolist() == [2, 3, 6, 7]  # four distinct nodes' logits for six scored tokens
    mask = tree.ancestor_mask()
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]  # 7 sees 1 2 3 5, not 6
    assert mask[8].nonzero().flatten().tolist() == [0, 1, 6, 7, 8]  # the second prompt's 6


def _worker(model_dir: Path, rdzv: Path, **overrides) -> TrainingWorker:
    settings = WorkerSettings(
        model_path=str(model_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0),
        **overrides,
    )
    w = TrainingWorker(settings, init_method=f"file://{rdzv}")
    w.setup()
    return w


@pytest.mark.parametrize("trainable", [True, False], ids=["policy", "reference"])
def test_shared_prefix_logprobs_equal_padded(tiny_model_dir: Path, tmp_path: Path, trainable: bool) -> None:
    batch = _grpo_batch()
    padded = _worker(tiny_model_dir, tmp_path / "a", trainable=trainable)
    shared = _worker(tiny_model_dir, tmp_path / "b", trainable=trainable, share_prefixes=True)
    try:
        want = padded.compute_logprobs(batch, micro_batch_size=8, temperature=0.7)
        got = shared.compute_logprobs(batch, micro_batch_size=8, temperature=0.7)
    finally:
        padded.shutdown()
        shared.shutdown()
    assert_sums_close(got, want, VOCAB_SIZE)  # each log-softmax sums VOCAB_SIZE terms
    assert (got[batch.response_mask == 0] == 0).all()


def test_shared_prefix_critic_values_equal_padded(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = _grpo_batch(seed=2)
    padded = _worker(tiny_model_dir, tmp_path / "a", head="value")
    shared = _worker(tiny_model_dir, tmp_path / "b", head="value", share_prefixes=True)
    try:
        want = padded.compute_values(batch, micro_batch_size=5)
        got = shared.compute_values(batch, micro_batch_size=5)
    finally:
        padded.shutdown()
        shared.shutdown()
    assert_sums_close(got, want, INTERMEDIATE_SIZE)  # the longest sum behind a value is the MLP's


@pytest.mark.parametrize(
    "extra",
    [{}, {"gradient_checkpointing": True}, {"max_tokens_per_microbatch": 40}],
    ids=["row-count", "checkpointing", "token-budget"],
)
def test_shared_prefix_gradients_equal_padded(tiny_model_dir: Path, tmp_path: Path, extra) -> None:
    """Padded: one shared prompt forward per distinct prompt (micro-batches of 4 rows); prefix
    sharing: the whole micro-batch's trie in one row. Same gradients up to float round-off."""
    batch = _grpo_batch(seed=1)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    grads, losses = [], []
    for i, (settings, micro) in enumerate((({}, 4), ({"share_prefixes": True, **extra}, 12))):
        w = _worker(tiny_model_dir, tmp_path / f"rdzv{i}", **settings)
        try:
            w.zero_grad()
            metrics = w.accumulate_gradients(batch, objective, micro_batch_size=micro, temperature=0.9)
            grads.append({n: p.grad.detach().clone() for n, p in w._model().named_parameters()})
            losses.append(metrics["policy_loss"])
        finally:
            w.shutdown()
    tokens = int(batch.attention_mask.sum())  # a weight's gradient sums one term per token
    assert_gradients_close(grads[1], grads[0], tokens)
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-3  # the gradients are not all ~0


def test_eager_attention_takes_an_additive_mask_and_flash_attention_is_refused(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    batch = _grpo_batch(seed=3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        want = response_logprobs(model, batch, share_prompts=False) * batch.response_mask
        got = prefix_tree_response_logprobs(model, batch)
    assert_sums_close(got, want, VOCAB_SIZE)  # each log-softmax sums VOCAB_SIZE terms
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="prefix sharing needs one of the attention implementations"):
        prefix_tree_response_logprobs(model, batch)


def test_config_key_reaches_the_workers() -> None:
    from skylift.cluster.settings import critic_worker_settings, model_worker_settings
    from skylift.config import load_config

    cfg = load_config(["trainer.share_prefixes=true"])
    for settings in (model_worker_settings(cfg, True, 10), critic_worker_settings(cfg, 10)):
        assert settings.share_prefixes is True
    assert model_worker_settings(load_config([]), True, 10).share_prefixes is False
