"""The GPU check's issue-53 items in-process on CPU: the rows the vision item trains on are the RL
trainer's, and the MoE item's routing checks fail when the replay does nothing (the end-to-end run
of both items is `test_gpu_check_script.py`'s)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from gpucheck import moe, vision
from gpucheck.policy import settings_for
from gpucheck.report import Item

from skylift.worker.routing_replay import routing_of
from skylift.worker.training_worker import TrainingWorker

FORWARD_CHECKS = {
    "replayed experts differing from the given ones",
    "logprobs with replayed routing, max |diff|",
}


def _nothing(*args: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@pytest.mark.parametrize("tied", [False, True], ids=["weights", "ties"])
def test_the_forward_checks_fail_when_the_replay_does_nothing(
    tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = moe.moe_dir()
    model = moe._load(path, torch.float32, "cpu", tied)
    ids = moe.forward_ids(moe.vocab_size(path))
    given = moe.engine_routing(routing_of(model, input_ids=ids), int(model.config.num_experts))
    if tied:  # every expert scores the same: the given experts are not the top-k's own order
        given[given >= 0] = (given[given >= 0] + 3) % int(model.config.num_experts)
    tag = "ties-fp32" if tied else "fp32"
    refs = {f"moe/forward/{tag}": moe.replay_forward(path, torch.float32, tied, ids, given)}
    item = Item("moe", "replayed")
    moe._check_forward(item, tag, moe.replay_forward(path, torch.float32, tied, ids, given), refs, given)
    assert item.ok and len(item.checks) == 3, [c for c in item.checks if not c.ok]

    monkeypatch.setattr(moe, "replay_routing", _nothing)
    broken = Item("moe", "not replayed")
    moe._check_forward(broken, tag, moe.replay_forward(path, torch.float32, tied, ids, given), refs, given)
    failed = {c.name.split(": ", 1)[1] for c in broken.checks if not c.ok}
    assert failed == FORWARD_CHECKS  # other experts picked, other logprobs


def test_the_worker_check_fails_when_the_worker_does_not_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    path = moe.moe_dir()
    model = moe._load(path, torch.float32, "cpu")
    batch = moe.batch_for(moe.vocab_size(path))
    routing = [
        moe.engine_routing(routing_of(model, input_ids=moe._row_ids(batch, i)[None]), 8)
        for i in range(batch.batch_size)
    ]
    rows = moe.routed_batch(batch, routing)
    worker = TrainingWorker(settings_for(path, "fp32"))
    worker.setup()
    try:
        item = Item("moe", "replayed")
        moe._check_worker_replay(item, "fp32", worker, rows)
        assert item.ok and item.figures["moe/fp32: replayed (token, layer) pairs"] > 0
        monkeypatch.setattr(moe, "replayed", _nothing)
        broken = Item("moe", "not replayed")
        moe._check_worker_replay(broken, "fp32", worker, rows)
        assert not broken.ok and broken.checks[0].value > 0
    finally:
        worker.shutdown()


def test_the_vision_rows_are_the_rl_trainers() -> None:
    assert vision.missing() is None  # Pillow is installed here
    path = vision.vl_dir()
    batch, counts = vision.rows(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    grids = [r.get("image_grid_thw") for r in batch.row_inputs or []]
    # 112x56 -> 1x4x8 patches -> 8 tokens (twice: two samples); 2 x 28x28 -> 1 token each, and the
    # observation's 56x28 -> 2 tokens; the text row has none
    assert [None if g is None else g.tolist() for g in grids] == [
        [[1, 4, 8]],
        [[1, 4, 8]],
        [[1, 2, 2], [1, 2, 2], [1, 2, 4]],
        None,
    ]
    image = config.image_token_id
    assert [int((row == image).sum()) for row in batch.input_ids] == [8, 8, 4, 0]
    assert counts == {
        "image tokens": 20,
        "images": 5,
        "patches": 80,
        "tokens": int(batch.attention_mask.sum()),
    }
    # the observation's image tokens are in the response, untrained
    response = batch.response_ids[2]
    assert int((response == image).sum()) == 2
    assert not bool(batch.response_mask[2][response == image].any())
    # the two samples of a prompt: the same processing, each row its own entry
    first, second = (batch.row_inputs or [])[:2]
    assert torch.equal(first["pixel_values"], second["pixel_values"])
