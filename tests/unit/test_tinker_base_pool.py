"""LoRA training clients of one base model share one resident copy of its weights
(`skylift.tinker.training.base_pool`), and never each other's adapters, gradients or optimizer state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from skylift.tinker.core.wire import ForwardBackwardCall, WireDatum
from skylift.tinker.training.base_pool import BasePool, tensor_bytes
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


def _client(pool: BasePool | None, path: Path, model_id: str, rank: int = 4, seed: int = 0) -> TrainedModel:
    model = TrainedModel(model_id, ModelConfig("tiny", str(path), lora_rank=rank, seed=seed), 2, pool)
    model.setup()
    return model


def _frozen(model: TrainedModel) -> dict[str, torch.Tensor]:
    assert model.worker is not None and model.worker.model is not None
    return {n: p for n, p in model.worker.model.named_parameters() if not p.requires_grad}


def _trained(model: TrainedModel) -> dict[str, torch.Tensor]:
    assert model.worker is not None and model.worker.model is not None
    return {n: p.detach().clone() for n, p in model.worker.model.named_parameters() if p.requires_grad}


def _data(offset: int) -> list[WireDatum]:
    rows = [[3 + (offset + 5 * i + 3 * j) % 50 for j in range(10)] for i in range(3)]
    return [
        WireDatum(tokens=r[:-1], inputs={"target_tokens": np.array(r[1:]), "weights": np.ones(9, np.float32)})
        for r in rows
    ]


def _step(model: TrainedModel, data: list[WireDatum]) -> None:
    call = ForwardBackwardCall(
        model_id=model.model_id, seq_id=1, loss_fn="cross_entropy", forward_only=False, data=data
    )
    model.forward_backward(call)


def test_two_lora_clients_hold_the_same_base_tensors_not_copies(tiny_model_dir: Path) -> None:
    pool = BasePool()
    a, b = _client(pool, tiny_model_dir, "a"), _client(pool, tiny_model_dir, "b", rank=8)
    fa, fb = _frozen(a), _frozen(b)
    assert fa.keys() == fb.keys() and len(fa) > 10
    for name in fa:
        assert fa[name] is fb[name], name
        assert fa[name].untyped_storage().data_ptr() == fb[name].untyped_storage().data_ptr()
    template = pool.resident(str(tiny_model_dir))
    assert template is not None and template.clients == {"a", "b"}
    ptrs = {p.data_ptr() for p in template.template.parameters()}
    assert {p.data_ptr() for p in fa.values()} <= ptrs
    # the adapters are each client's own
    ta, tb = dict(a.worker.model.named_parameters()), dict(b.worker.model.named_parameters())
    assert (
        ta[f"{Q_PROJ}.lora_A.default.weight"].data_ptr() != tb[f"{Q_PROJ}.lora_A.default.weight"].data_ptr()
    )
    assert pool.stats()["base_loads"] == 1


def test_a_base_stored_in_another_dtype_is_converted_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    pool = BasePool()
    a, b = _client(pool, bf16, "a"), _client(pool, bf16, "b")
    fa, fb = _frozen(a), _frozen(b)
    for name in fa:
        assert fa[name].dtype == torch.float32
        assert fa[name].untyped_storage().data_ptr() == fb[name].untyped_storage().data_ptr(), name
    resident = pool.resident(str(bf16))
    assert resident is not None
    numel = sum(p.numel() for p in resident.template.parameters())
    assert (
        resident.nbytes
        == tensor_bytes(resident.template)
        == numel * 4 + sum(t.untyped_storage().nbytes() for t in resident.template.buffers())
    )
    assert len(pool.stats()["resident_base_models"]) == 1


def test_adapters_trained_interleaved_equal_each_trained_alone(tiny_model_dir: Path) -> None:
    pool = BasePool()
    a, b = _client(pool, tiny_model_dir, "a", seed=1), _client(pool, tiny_model_dir, "b", seed=2)
    base_before = {n: p.detach().clone() for n, p in _frozen(a).items()}
    for _ in range(3):  # gradients of both pending at once, steps in between the other's
        _step(a, _data(0))
        _step(b, _data(7))
        a.optim_step(ADAM)
        _step(b, _data(7))
        b.optim_step(ADAM)
    alone_a = _client(BasePool(), tiny_model_dir, "a-alone", seed=1)
    alone_b = _client(BasePool(), tiny_model_dir, "b-alone", seed=2)
    for _ in range(3):
        _step(alone_a, _data(0))
        alone_a.optim_step(ADAM)
    for _ in range(3):
        _step(alone_b, _data(7))
        _step(alone_b, _data(7))
        alone_b.optim_step(ADAM)
    for shared, alone in ((a, alone_a), (b, alone_b)):
        got, want = _trained(shared), _trained(alone)
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.equal(_trained(a)[f"{Q_PROJ}.lora_B.default.weight"], torch.zeros(1))
    for name, p in _frozen(a).items():  # the shared base was never written
        assert torch.equal(p, base_before[name]), name


def test_a_checkpoint_loads_into_a_shared_client_without_writing_the_base(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    pool = BasePool()
    a = _client(pool, tiny_model_dir, "a", seed=1)
    _step(a, _data(0))
    a.optim_step(ADAM)
    a.save_state(tmp_path / "ckpt")
    c = _client(pool, tiny_model_dir, "c", seed=5)
    base = {n: (p.data_ptr(), p.detach().clone()) for n, p in _frozen(c).items()}
    c.load_state(tmp_path / "ckpt", optimizer=True)
    for name, value in _trained(a).items():
        torch.testing.assert_close(_trained(c)[name], value, rtol=0, atol=0)
    for name, p in _frozen(c).items():
        assert p.data_ptr() == base[name][0] and torch.equal(p, base[name][1]), name
    assert c.worker.optimizer.state  # the optimizer state came with it
    # both train on from here alike
    _step(a, _data(3))
    _step(c, _data(3))
    a.optim_step(ADAM)
    c.optim_step(ADAM)
    for name, value in _trained(a).items():
        torch.testing.assert_close(_trained(c)[name], value)


def test_the_last_client_gone_evicts_the_base_and_a_full_fine_tune_keeps_its_own(
    tiny_model_dir: Path,
) -> None:
    pool = BasePool()
    a, b = _client(pool, tiny_model_dir, "a"), _client(pool, tiny_model_dir, "b")
    full = _client(pool, tiny_model_dir, "full", rank=0)
    assert full.pool is None
    shared = {p.data_ptr() for p in _frozen(a).values()}
    assert not shared & {p.data_ptr() for p in full.worker.model.parameters()}
    a.close()
    assert pool.stats()["base_evictions"] == 0 and pool.resident(str(tiny_model_dir)) is not None
    b.close()
    b.close()  # twice is harmless
    assert pool.stats()["base_evictions"] == 1 and pool.resident(str(tiny_model_dir)) is None
    again = _client(pool, tiny_model_dir, "again")
    assert pool.stats()["base_loads"] == 2 and again.worker is not None


@pytest.mark.parametrize("rank", [4])
def test_a_client_without_a_pool_gets_a_private_one(tiny_model_dir: Path, rank: int) -> None:
    model = _client(None, tiny_model_dir, "solo", rank=rank)
    assert model.pool is not None and model.pool.resident(str(tiny_model_dir)) is not None
    model.close()
    assert model.pool.resident(str(tiny_model_dir)) is None
