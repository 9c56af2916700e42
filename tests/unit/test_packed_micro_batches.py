"""Token-budget micro-batches and padding-free (packed) passes: the same numbers as padded ones."""

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
from skylift.worker.micro_batches import micro_batch_rows, pack
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def _grpo_batch(vocab: int = 500, prompts: int = 3, group: int = 4, seed: int = 0) -> SequenceBatch:
    """`prompts` distinct prompts of different lengths, each answered `group` times (the GRPO
    layout, which the padded path runs through one shared prompt forward per prompt)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_rows, responses = [], []
    for _ in range(prompts):
        prompt = torch.randint(5, vocab, (int(torch.randint(3, 10, (1,), generator=gen)),), generator=gen)
        for _ in range(group):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            prompt_rows.append(prompt.tolist())
            responses.append(torch.randint(5, vocab, (n,), generator=gen).tolist())
    batch = build_sequence_batch(prompt_rows, responses, pad_token_id=0)
    advantages = torch.randn(len(responses), 1, generator=gen).expand(-1, batch.response_len)
    return batch.with_extras(advantages=(advantages * batch.response_mask).contiguous())


def test_token_budget_counts_padded_cells_or_real_tokens() -> None:
    # real lengths (prompt + response): 5+3, 2+1, 4+4 -> rows ordered longest first: 0, 2, 1
    batch = build_sequence_batch([[1] * 5, [2] * 2, [3] * 4], [[7] * 3, [8], [9] * 4])
    assert micro_batch_rows(batch, max_rows=2) == [[0, 2], [1]]
    # packed: 8 + 8 = 16 fits a budget of 16, the next row starts a new micro-batch
    assert micro_batch_rows(batch, max_rows=1, max_tokens=16, packed=True) == [[0, 2], [1]]
    assert micro_batch_rows(batch, max_rows=1, max_tokens=15, packed=True) == [[0], [2, 1]]
    # padded: rows 0 and 2 are 2 x (5 + 4) = 18 cells; adding row 1 makes 3 x 9 = 27
    assert micro_batch_rows(batch, max_rows=1, max_tokens=18) == [[0, 2], [1]]
    assert micro_batch_rows(batch, max_rows=1, max_tokens=26) == [[0, 2], [1]]
    assert micro_batch_rows(batch, max_rows=1, max_tokens=27) == [[0, 2, 1]]
    # a row longer than the budget gets a micro-batch of its own instead of being split
    assert micro_batch_rows(batch, max_rows=1, max_tokens=4, packed=True) == [[0], [2], [1]]


def test_pack_places_each_sequence_end_to_end() -> None:
    batch = build_sequence_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    layout = pack(batch)
    assert layout.input_ids.tolist() == [[1, 2, 3, 5, 6, 4, 7, 8, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # token 5 is predicted at position 2 (after 1 2 3), 6 at 3; 7 at 5 (after 4), 8 at 6, 9 at 7
    assert layout.keep.tolist() == [2, 3, 5, 6, 7]
    assert layout.targets.tolist() == [5, 6, 7, 8, 9]


def _worker(model_dir: Path, rdzv: Path, **overrides) -> TrainingWorker:
    settings = WorkerSettings(
        model_path=str(model_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0),
        **overrides,
    )
    w = TrainingWorker(settings, init_method=f"file://{rdzv}")
    w.setup()
    return w


PACKED = {"remove_microbatch_padding": True, "max_tokens_per_microbatch": 40}


@pytest.mark.parametrize("trainable", [True, False], ids=["policy", "reference"])
def test_packed_logprobs_equal_padded(tiny_model_dir: Path, tmp_path: Path, trainable: bool) -> None:
    batch = _grpo_batch()
    padded = _worker(tiny_model_dir, tmp_path / "a", trainable=trainable)
    packed = _worker(tiny_model_dir, tmp_path / "b", trainable=trainable, **PACKED)
    try:
        want = padded.compute_logprobs(batch, micro_batch_size=4, temperature=0.7)
        got = packed.compute_logprobs(batch, micro_batch_size=4, temperature=0.7)
    finally:
        padded.shutdown()
        packed.shutdown()
    assert_sums_close(got, want, VOCAB_SIZE)  # each log-softmax sums VOCAB_SIZE terms


def test_packed_critic_values_equal_padded(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = _grpo_batch(seed=2)
    padded = _worker(tiny_model_dir, tmp_path / "a", head="value")
    packed = _worker(tiny_model_dir, tmp_path / "b", head="value", **PACKED)
    try:
        want = padded.compute_values(batch, micro_batch_size=3)
        got = packed.compute_values(batch, micro_batch_size=3)
    finally:
        padded.shutdown()
        packed.shutdown()
    assert_sums_close(got, want, INTERMEDIATE_SIZE)  # the longest sum behind a value is the MLP's


@pytest.mark.parametrize("budget", [None, 30], ids=["row-count", "token-budget"])
def test_packed_gradients_equal_padded_shared_prompt(tiny_model_dir: Path, tmp_path: Path, budget) -> None:
    """The padded path shares each prompt's forward across its group (micro-batches of 4 rows =
    one prompt each); the packed path runs full sequences. Same gradients up to float round-off."""
    batch = _grpo_batch(seed=1)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    grads = []
    for i, extra in enumerate(({}, {"remove_microbatch_padding": True, "max_tokens_per_microbatch": budget})):
        w = _worker(tiny_model_dir, tmp_path / f"rdzv{i}", **extra)
        try:
            w.zero_grad()
            metrics = w.accumulate_gradients(batch, objective, micro_batch_size=4, temperature=0.9)
            model = w._model()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            assert metrics
        finally:
            w.shutdown()
    tokens = int(batch.attention_mask.sum())  # a weight's gradient sums one term per token
    assert_gradients_close(grads[1], grads[0], tokens)
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-3  # the gradients are not all ~0


def test_config_keys_reach_the_workers() -> None:
    from skylift.cluster.settings import critic_worker_settings, model_worker_settings
    from skylift.config import load_config
    from skylift.config.errors import ConfigError

    cfg = load_config(["trainer.max_tokens_per_microbatch=256", "trainer.remove_microbatch_padding=true"])
    for settings in (model_worker_settings(cfg, True, 10), critic_worker_settings(cfg, 10)):
        assert settings.max_tokens_per_microbatch == 256
        assert settings.remove_microbatch_padding is True
    assert model_worker_settings(load_config([]), True, 10).max_tokens_per_microbatch is None
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch=0 must be >= 1, or -1 for row counts"):
        load_config(["trainer.max_tokens_per_microbatch=0"])
