"""`TrainedModel` runs Tinker datums through the `TrainingWorker` (no server): logprobs equal a
plain forward pass, 2-D targets score K tokens per position, gradients accumulate across calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb
from tolerances import assert_gradients_close, assert_sums_close

from skylift.models.tiny_qwen2 import VOCAB_SIZE
from skylift.tinker.core.wire import ForwardBackwardCall, WireDatum
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel

TOKENS = [5 + (j * 5) % 37 for j in range(12)]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> TrainedModel:
    m = TrainedModel("t", ModelConfig(base_model="tiny", model_path=str(tiny_model_dir), lora_rank=4), 2)
    m.setup()
    return m


def _datum(tokens: list[int], targets: np.ndarray, **inputs: np.ndarray) -> WireDatum:
    return WireDatum(tokens=tokens, inputs={"target_tokens": targets, **inputs})


def _call(
    data: list[WireDatum], forward_only: bool = True, loss: str = "cross_entropy"
) -> ForwardBackwardCall:
    return ForwardBackwardCall(model_id="t", seq_id=1, loss_fn=loss, forward_only=forward_only, data=data)


def _decode(model: TrainedModel, call: ForwardBackwardCall) -> tuple[list[np.ndarray], dict[str, float]]:
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(model.forward_backward(call))
    field = msg.loss_fn_outputs[0].fields["logprobs"]
    offsets = np.frombuffer(field.offsets, dtype=np.int64)
    data = np.frombuffer(field.data, dtype=np.float32)
    rows = [data[offsets[i] // 4 : offsets[i + 1] // 4] for i in range(len(offsets) - 1)]
    return rows, dict(msg.metrics)


def _reference(model: TrainedModel, tokens: list[int], targets: np.ndarray) -> np.ndarray:
    net = model.worker.model
    with torch.no_grad():
        logits = net(input_ids=torch.tensor([tokens]), use_cache=False).logits.float()[0]
    logp = logits.log_softmax(-1)
    t = torch.as_tensor(targets.astype(np.int64))
    return (logp.gather(-1, t) if t.dim() == 2 else logp.gather(-1, t[:, None])[:, 0]).numpy()


def test_logprobs_match_a_plain_forward_for_rows_of_any_length(model: TrainedModel) -> None:
    a, b = TOKENS, TOKENS[:5]
    ta, tb = np.array(a[1:] + [9]), np.array([11, 3, 8, 8, 2])  # arbitrary targets, not just shifted
    rows, metrics = _decode(model, _call([_datum(a, ta), _datum(b, tb), _datum(a[:7], ta[:7])]))
    # padded micro-batches vs one unpadded row: each log-softmax sums VOCAB_SIZE terms
    assert_sums_close(torch.tensor(rows[0]), torch.tensor(_reference(model, a, ta)), VOCAB_SIZE)
    assert_sums_close(torch.tensor(rows[1]), torch.tensor(_reference(model, b, tb)), VOCAB_SIZE)
    expected = -sum(float(r.sum()) for r in rows)
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_two_d_targets_score_k_tokens_per_position(model: TrainedModel) -> None:
    targets = np.stack([np.array(TOKENS[1:] + [4]), np.full(len(TOKENS), 7)], axis=1)
    weights = np.tile(np.array([[1.0, 0.25]], dtype=np.float32), (len(TOKENS), 1))
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(model.forward_backward(_call([_datum(TOKENS, targets, weights=weights)])))
    ref = _reference(model, TOKENS, targets)
    assert msg.metrics["loss:sum"] == pytest.approx(float(-(ref * weights).sum()), rel=1e-5)


def test_gradients_accumulate_until_the_optimizer_step(model: TrainedModel) -> None:
    data = [_datum(TOKENS[i:], np.array(TOKENS[i + 1 :] + [3])) for i in range(4)]
    worker = model.worker
    model.forward_backward(_call(data, forward_only=False))
    full = {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}
    worker.zero_grad()
    model.forward_backward(_call(data[:1], forward_only=False))
    model.forward_backward(_call(data[1:], forward_only=False))
    split = {n: p.grad for n, p in worker.model.named_parameters() if p.grad is not None}
    assert_gradients_close(split, full, sum(len(d.tokens) for d in data))  # one term per token
    before, _ = _decode(model, _call(data[:1]))
    out = model.optim_step({"learning_rate": 1e-2, "grad_clip_norm": 1.0})
    assert out["learning_rate"] == 1e-2 and out["grad_norm"] > 0
    assert all(p.grad is None for p in worker.model.parameters())
    after, _ = _decode(model, _call(data[:1]))
    assert not np.allclose(before[0], after[0])


def test_a_lora_sampler_export_holds_its_adapter_and_its_snapshot_may_hold_only_that(
    model: TrainedModel, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from skylift.tinker.sampling.weights import adapter_in, merged_into_base

    model.export_sampler(tmp_path / "sampler")
    found = adapter_in(tmp_path / "sampler")
    assert found is not None and found.rank == 4 and found.directory is not None
    lean = model.snapshot_sampler(with_full=False)
    assert lean.full is None and lean.adapter is not None and lean.adapter.tensors is not None
    on_disk = load_file(str(found.directory / "adapter_model.safetensors"))
    assert on_disk.keys() == lean.adapter.tensors.keys()
    assert all(torch.equal(on_disk[k], lean.adapter.tensors[k]) for k in on_disk)
    assert lean.adapter.config is not None and lean.adapter.config["r"] == 4
    both = model.snapshot_sampler(with_full=True)
    assert both.full is not None and both.nbytes > 2 * lean.nbytes  # the merged weights dwarf it
    # a weight swap merges the adapter into the base on demand: the trainer's own merged weights
    merged = merged_into_base(model.config.model_path, lean.adapter)
    assert merged.keys() >= both.full.keys() - {"lm_head.weight"}
    for name, tensor in both.full.items():
        torch.testing.assert_close(merged.get(name, tensor), tensor, rtol=0, atol=1e-6, msg=name)
