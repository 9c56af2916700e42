"""Routing replay in the trainer: each row's routed experts (`SequenceBatch.row_inputs`) laid out on
the padded micro-batch's positions, -1 keeping the trainer's own routing, through micro-batch
selection, ranks' shards, the packed / prefix-sharing fallbacks and gradient checkpointing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from skylift.config.schema import OptimizerConfig
from skylift.models import prepare_model
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.logprobs import response_logprobs
from skylift.worker.routing_replay import (
    ROUTED_EXPERTS,
    RoutingReplayError,
    batch_routing,
    moe_routers,
    replay_routing,
    replayed,
    routing_of,
)
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

PROMPTS = [[5, 9, 13, 21, 30], [7, 11], [40, 41, 42], [7, 11]]
RESPONSES = [[50, 51], [60, 61, 62, 63, 64], [70], [65, 66, 67]]


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return prepare_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def model(moe_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _picked(model: Any, **inputs: Any) -> torch.Tensor:
    """The experts each router picked in one forward: [tokens, MoE layers, top_k]."""
    routed = routing_of(model, **inputs)
    return routed[:, sorted(moe_routers(model))]


def _engine_routing(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    """A routing other than the trainer's own (every expert shifted by one) for the row's tokens,
    the last token not routed (-1), as an engine returns it."""
    experts = next(iter(moe_routers(model).values())).num_experts
    own = routing_of(model, input_ids=torch.tensor([prompt + response]))
    other = (own + 1) % experts
    other[-1] = -1
    return other


def _routed_batch(model: Any, rows: list[int] | None = None) -> SequenceBatch:
    rows = list(range(len(PROMPTS))) if rows is None else rows
    batch = build_sequence_batch([PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows])
    batch.row_inputs = [{ROUTED_EXPERTS: _engine_routing(model, PROMPTS[i], RESPONSES[i])} for i in rows]
    return batch


def _row_reference(model: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i alone (no padding) under its engine routing: (response logprobs, picked experts)."""
    ids = torch.tensor([PROMPTS[i] + RESPONSES[i]])
    routed = _engine_routing(model, PROMPTS[i], RESPONSES[i])
    single = build_sequence_batch([PROMPTS[i]], [RESPONSES[i]])
    with torch.no_grad(), replay_routing(model, routed):
        logprobs = response_logprobs(model, single)[0]
    with replay_routing(model, routed):
        picked = _picked(model, input_ids=ids)
    return logprobs, picked


def test_replay_with_partial_minus_one_rows_keeps_own_routing_there(model: Any) -> None:
    ids = torch.tensor([PROMPTS[0] + RESPONSES[0], PROMPTS[2] + RESPONSES[0] + [3, 4]])
    own = routing_of(model, input_ids=ids)
    experts = next(iter(moe_routers(model).values())).num_experts
    given = (own + 3) % experts
    given[:4] = -1  # whole tokens not routed
    given[9, 2] = -1  # one token, one layer
    given[11, 0, 1] = -1  # half a row: the token keeps its own pick in that layer
    with replay_routing(model, given):
        picked = routing_of(model, input_ids=ids)
    missing = (given < 0).any(-1, keepdim=True).expand_as(given)
    assert torch.equal(picked[missing], own[missing])
    assert torch.equal(picked[~missing], given[~missing])
    assert int(missing.any(-1).sum()) == 4 * own.shape[1] + 2


def test_batch_routing_lays_rows_on_padded_positions(model: Any) -> None:
    batch = _routed_batch(model)
    batch.row_inputs[2] = {}  # a row without routing: -1 everywhere
    flat = batch_routing(batch)
    width = batch.input_ids.shape[1]
    assert flat is not None and flat.shape[0] == batch.batch_size * width
    layout = flat.reshape(batch.batch_size, width, *flat.shape[1:])
    for i in (0, 1, 3):
        real = batch.attention_mask[i].bool()
        assert torch.equal(layout[i, real], batch.row_inputs[i][ROUTED_EXPERTS])
        assert bool((layout[i, ~real] == -1).all())
    assert bool((layout[2] == -1).all())
    assert batch_routing(build_sequence_batch(PROMPTS, RESPONSES)) is None


def test_padded_forward_replays_each_rows_routing(model: Any) -> None:
    batch = _routed_batch(model)
    with torch.no_grad(), replayed(model, batch):
        got = response_logprobs(model, batch)
    with replayed(model, batch):
        picked = _picked(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    with torch.no_grad():
        plain = response_logprobs(model, batch)
    width = batch.input_ids.shape[1]
    picked = picked.reshape(batch.batch_size, width, *picked.shape[1:])
    for i in range(batch.batch_size):
        want_lp, want_picked = _row_reference(model, i)
        n = len(RESPONSES[i])
        torch.testing.assert_close(got[i, :n], want_lp, atol=1e-5, rtol=0)
        assert not torch.allclose(plain[i, :n], want_lp, atol=1e-3)  # the replay changed them
        real = picked[i, batch.attention_mask[i].bool()]
        assert int((real != want_picked).any(-1).sum()) == 0  # 0 differing (token, layer) routings


def test_misaligned_routing_is_a_one_line_error(model: Any) -> None:
    batch = _routed_batch(model)
    batch.row_inputs[1] = {ROUTED_EXPERTS: batch.row_inputs[1][ROUTED_EXPERTS][:-2]}
    with pytest.raises(RoutingReplayError, match="batch row 1 has 7 tokens but routed experts of shape"):
        batch_routing(batch)


def _worker(moe_dir: Path, rdzv: Path, **overrides: Any) -> TrainingWorker:
    settings = WorkerSettings(
        model_path=str(moe_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0),
        **overrides,
    )
    w = TrainingWorker(settings, init_method=f"file://{rdzv}")
    w.setup()
    return w


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"remove_microbatch_padding": True, "max_tokens_per_microbatch": 16},
        {"share_prefixes": True},
    ],
    ids=["padded", "packed-falls-back", "prefix-tree-falls-back"],
)
def test_worker_logprobs_replay_through_micro_batches_and_shards(
    model: Any, moe_dir: Path, tmp_path: Path, overrides: dict[str, Any]
) -> None:
    batch = _routed_batch(model)
    want = [_row_reference(model, i)[0] for i in range(batch.batch_size)]
    worker = _worker(moe_dir, tmp_path / "rdzv", trainable=False, **overrides)
    try:
        results = {
            size: worker.compute_logprobs(batch, micro_batch_size=size) for size in (1, 3, batch.batch_size)
        }
        # the worker group's shards of two ranks: each rank's rows with their own routing
        shards = {
            rows: worker.compute_logprobs(batch.select(rows), micro_batch_size=2) for rows in ((0, 1), (2, 3))
        }
    finally:
        worker.shutdown()
    for got in results.values():
        for i, lp in enumerate(want):
            torch.testing.assert_close(got[i, : len(RESPONSES[i])], lp, atol=1e-5, rtol=0)
    for rows, got in shards.items():
        for j, i in enumerate(rows):
            torch.testing.assert_close(got[j, : len(RESPONSES[i])], want[i], atol=1e-5, rtol=0)


def test_training_replays_in_the_backward_of_checkpointed_layers(
    model: Any, moe_dir: Path, tmp_path: Path
) -> None:
    """Gradient checkpointing recomputes each layer's forward in the backward: the replay spans it,
    so the gradient equals the one without checkpointing (and differs from no replay)."""
    batch = _routed_batch(model)

    def loss_fn(logp: torch.Tensor, micro: SequenceBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return (logp * micro.response_mask).sum(), {}

    grads = {}
    for name, checkpointing, routed in (("plain", False, True), ("ckpt", True, True), ("own", False, False)):
        worker = _worker(moe_dir, tmp_path / name, gradient_checkpointing=checkpointing)
        try:
            rows = batch if routed else build_sequence_batch(PROMPTS, RESPONSES)
            worker.zero_grad()
            worker.accumulate_gradients(rows, loss_fn, micro_batch_size=2)
            grads[name] = torch.cat(
                [p.grad.flatten() for p in worker.model.parameters() if p.grad is not None]
            )
        finally:
            worker.shutdown()
    torch.testing.assert_close(grads["ckpt"], grads["plain"], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(grads["own"], grads["plain"], atol=1e-3)
