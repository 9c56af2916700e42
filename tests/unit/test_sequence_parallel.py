"""Ulysses sequence parallelism (SkyRL's `trainer.<model>.sequence_parallel_size`): two gloo ranks
that split every sequence compute the logprobs, values and gradients one rank computes on the
whole batch, and take the same GRPO step (a worker-level step: old logprobs, group-relative
advantages, one optimizer step, no engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_two_ranks
from server_helpers import require_loopback_namespace
from tolerances import assert_gradients_close, assert_sums_close, sum_tolerance

from skylift.algorithms import mini_batch_totals
from skylift.algorithms.advantages import grpo_advantages
from skylift.config import ConfigError, load_config
from skylift.config.schema import OptimizerConfig
from skylift.models.tiny_qwen2 import INTERMEDIATE_SIZE
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.sequence_parallel import concat_batches
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

# One rank of a 2-rank group with sequence_parallel_size=2: its half of the batch (the worker
# group's contiguous shards), pooled with the other rank's and split along the sequence.
RANK = r"""
import sys, torch
from skylift.worker.sharding import full_tensor
from skylift.config.schema import OptimizerConfig
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings
rank, rdzv, model_dir, odd_dir, inputs, out = int(sys.argv[1]), *sys.argv[2:]
batch, objective = torch.load(inputs, weights_only=False)
half = batch.batch_size // 2
mine = batch.select(list(range(rank * half, (rank + 1) * half)))
def worker(path, **kw):
    w = TrainingWorker(WorkerSettings(model_path=path, sequence_parallel_size=2, **kw), rank, 2, rdzv)
    w.setup()
    return w
policy = worker(model_dir, gradient_checkpointing=True, optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0))
old = policy.compute_logprobs(mine, micro_batch_size=2)
policy.zero_grad()
policy.accumulate_gradients(mine.with_extras(old_logprobs=old), objective, micro_batch_size=2)
grads = {n: full_tensor(p.grad) for n, p in policy.model.named_parameters()}
policy.optimizer_step()
weights = {k: v.clone() for k, v in policy.iter_full_weights()}
values = worker(model_dir, head="value", trainable=False).compute_values(mine, micro_batch_size=3)
odd = worker(odd_dir, trainable=False).compute_logprobs(mine, micro_batch_size=8)
result = {"old": old, "values": values, "odd": odd}
if rank == 0:
    result.update(grads=grads, weights=weights)
torch.save(result, f"{out}{rank}.pt")
policy.shutdown()
"""


def _grpo_batch(vocab: int, groups: int = 2, samples: int = 4, seed: int = 5) -> SequenceBatch:
    """`groups` prompts with `samples` responses each, group-relative advantages of random rewards."""
    gen = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=gen))
        return torch.randint(5, vocab, (length,), generator=gen).tolist()

    prompts = [p for p in (ids(4, 12) for _ in range(groups)) for _ in range(samples)]
    batch = build_sequence_batch(prompts, [ids(2, 11) for _ in prompts], pad_token_id=0)
    rewards = torch.rand(len(prompts), generator=gen)
    group_ids = [i // samples for i in range(len(prompts))]
    advantages, _ = grpo_advantages(
        sequence_rewards=rewards, response_mask=batch.response_mask, group_ids=group_ids
    )
    return batch.with_extras(advantages=advantages)


def _odd_heads_model(directory: Path) -> Path:
    """A random Qwen2 with 3 query heads and 1 key/value head: heads that 2 ranks cannot split."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from skylift.models import prepare_model

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(prepare_model("tiny-qwen2")).save_pretrained(directory)
    return directory


def _single(path: Path, **kw: object) -> TrainingWorker:
    worker = TrainingWorker(WorkerSettings(model_path=str(path), **kw))  # type: ignore[arg-type]
    worker.setup()
    return worker


def test_two_sequence_parallel_ranks_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_loopback_namespace()  # two gloo ranks listen on every interface
    batch = _grpo_batch(vocab=500)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    odd_dir = _odd_heads_model(tmp_path / "odd")
    torch.save((batch, objective), tmp_path / "inputs.pt")
    rdzv, out = f"file://{tmp_path / 'rdzv'}", str(tmp_path / "sp")
    args = [str(tiny_model_dir), str(odd_dir), str(tmp_path / "inputs.pt"), out]
    run_two_ranks(RANK, rdzv, args)
    results = [torch.load(f"{out}{r}.pt") for r in range(2)]

    def both(key: str) -> torch.Tensor:  # the two ranks' rows, back in batch order
        parts = [r[key] for r in results]
        full = torch.zeros(batch.batch_size, batch.response_len)
        half = batch.batch_size // 2
        for r, part in enumerate(parts):
            full[r * half : (r + 1) * half, : part.shape[1]] = part
        return full

    policy = _single(
        tiny_model_dir, optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0)
    )
    old = policy.compute_logprobs(batch, micro_batch_size=2)
    start = {k: v.detach().clone() for k, v in policy.iter_full_weights()}
    policy.zero_grad()
    policy.accumulate_gradients(batch.with_extras(old_logprobs=old), objective, micro_batch_size=2)
    grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters()}  # type: ignore[union-attr]
    policy.optimizer_step()
    reference = {k: v.detach().clone() for k, v in policy.iter_full_weights()}
    values = _single(tiny_model_dir, head="value", trainable=False).compute_values(batch, 3)
    odd = _single(odd_dir, trainable=False).compute_logprobs(batch, 8)

    figures = {}
    # a logprob or value is a chain of sums of at most INTERMEDIATE_SIZE terms (the MLP's); the
    # split path adds them in another order (another sequence length per kernel call)
    for name, got, want in (("logprobs", both("old"), old), ("values", both("values"), values)):
        assert_sums_close(got, want, INTERMEDIATE_SIZE, name)
        figures[name] = float((got - want).abs().max())
    assert_sums_close(both("odd"), odd, 96, "odd heads")
    figures["odd heads"] = float((both("odd") - odd).abs().max())
    # gradients sum one term per token (test_training_worker's micro-batch check)
    tokens = int(batch.attention_mask.sum())
    assert_gradients_close(results[0]["grads"], grads, tokens)
    figures["grads"] = max(float((results[0]["grads"][n] - g).abs().max()) for n, g in grads.items())
    # eps=1 makes the GRPO step ~ lr * grad (as in test_hybrid_sharding)
    scale: dict[str, float] = {}
    for name, weight in start.items():
        module = name.rsplit(".", 1)[0]
        scale[module] = max(scale.get(module, 0.0), float((reference[name] - weight).abs().max()))
    assert max(scale.values()) > 0
    for name, weight in start.items():
        tol = sum_tolerance(scale[name.rsplit(".", 1)[0]], tokens)
        tol += torch.finfo(weight.dtype).eps * float(weight.abs().max())
        worst = float((results[0]["weights"][name] - reference[name]).abs().max())
        assert worst <= tol, (name, worst, tol)
    assert max(figures.values()) <= 1e-5, figures  # the bar, below the derived tolerances here
    print("max |sp=2 - one rank|:", figures)


def test_pooled_batches_keep_every_row_and_extra() -> None:
    a = build_sequence_batch([[5, 6, 7]], [[8]], per_token={"advantages": [[1.0]]})
    b = build_sequence_batch([[9]], [[10, 11, 12]], per_token={"advantages": [[2.0, 3.0, 4.0]]})
    pooled = concat_batches([a, b])
    assert pooled.prompt_len == 3 and pooled.response_len == 3
    assert pooled.input_ids.tolist() == [[5, 6, 7, 8, 0, 0], [0, 0, 9, 10, 11, 12]]
    assert pooled.extras["advantages"].tolist() == [[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]]
    assert torch.equal(pooled.select([1]).input_ids, b.input_ids)


def test_sequence_parallel_size_is_live_and_must_divide_the_workers() -> None:
    from skylift.cluster.settings import critic_worker_settings, model_worker_settings

    cfg = load_config(
        [
            "trainer.placement.policy_num_gpus_per_node=4",
            "trainer.placement.ref_num_gpus_per_node=2",
            "trainer.placement.critic_num_gpus_per_node=2",
            "trainer.policy.sequence_parallel_size=4",
            "trainer.ref.sequence_parallel_size=2",
            "trainer.critic.sequence_parallel_size=2",
        ]
    )
    assert model_worker_settings(cfg, True, 1).sequence_parallel_size == 4
    assert model_worker_settings(cfg, False, 1).sequence_parallel_size == 2
    assert critic_worker_settings(cfg, 1).sequence_parallel_size == 2
    with pytest.raises(
        ConfigError, match=r"trainer.policy.sequence_parallel_size=3 must divide the policy's 4"
    ):
        load_config(
            ["trainer.placement.policy_num_gpus_per_node=4", "trainer.policy.sequence_parallel_size=3"]
        )
    with pytest.raises(ConfigError, match="sequence_parallel_backend='ring' is not implemented"):
        load_config(["trainer.sequence_parallel_backend=ring"])
    with pytest.raises(ValueError, match="sequence_parallel_size=2 must divide the 1 ranks"):
        TrainingWorker(WorkerSettings(model_path="tiny-qwen2", sequence_parallel_size=2)).setup()
