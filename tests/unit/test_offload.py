"""Trainer state offloaded to host memory and back (colocated training), as bookkeeping on CPU:
round trips are exact, parameters stay the same objects, a step after a round trip equals one
without, and a training worker brings its state back before any method that uses it."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from skylift.algorithms import mini_batch_totals
from skylift.config.schema import OptimizerConfig
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.offload import MODEL, OPTIMIZER, HostOffload, OffloadingWorker
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model.register_buffer("scale", torch.randn(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=gen)
    loss = (model(x) * model.scale).square().mean()
    loss.backward()
    optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, p in enumerate(model.parameters()):
        for key, value in optimizer.state[p].items():
            out[f"optim.{i}.{key}"] = value.clone()
    return out


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values()) + [p.grad for p in model.parameters() if p.grad is not None]
    for p in model.parameters():
        out += [v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    return {t.data_ptr() for t in _tensors(model, optimizer)}


def test_round_trip_is_exact_and_keeps_the_parameter_objects() -> None:
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, seed=1)  # gradients and AdamW's state exist
    params = list(model.parameters())
    before, storages = _state(model, optimizer), _storages(model, optimizer)
    held = _tensors(model, optimizer)  # the old tensors stay alive: their addresses cannot be reused
    offload = HostOffload(model, optimizer)

    moved = offload.offload([OPTIMIZER])
    assert offload.offloaded == (OPTIMIZER,)
    assert moved == sum(v.numel() * v.element_size() for p in params for v in optimizer.state[p].values())
    moved = offload.offload([MODEL, OPTIMIZER])  # the optimizer is already on the host: only the model
    assert offload.offloaded == (MODEL, OPTIMIZER)
    assert moved == sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None
    )
    # every tensor is a new copy (on CPU the host copy is the bookkeeping), equal bit for bit
    assert not storages & _storages(model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in _state(model, optimizer).items())
    del held

    offload.backload()
    assert offload.offloaded == ()
    after = _state(model, optimizer)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert value.dtype == after[key].dtype and value.device == after[key].device, key
        assert torch.equal(value, after[key]), key
    assert list(model.parameters()) == params  # the optimizer still refers to the model's parameters
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params, strict=True))


def test_a_step_after_a_round_trip_equals_one_without() -> None:
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, seed=1)
    twin_model = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin_model.parameters(), lr=1e-2, fused=True)
    twin_optimizer.load_state_dict(optimizer.state_dict())

    offload = HostOffload(model, optimizer)
    offload.offload()
    offload.backload([MODEL])
    offload.backload([OPTIMIZER])
    for m, o in ((model, optimizer), (twin_model, twin_optimizer)):
        o.zero_grad(set_to_none=True)
        _step(m, o, seed=2)
    got, want = _state(model, optimizer), _state(twin_model, twin_optimizer)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_unknown_part_is_refused_and_nothing_moves_twice() -> None:
    model, optimizer = _model_and_optimizer()
    offload = HostOffload(model, optimizer)
    with pytest.raises(ValueError, match=r"unknown offload part\(s\) \['gradients'\]"):
        offload.offload(["gradients"])
    assert offload.backload() == 0  # nothing offloaded: nothing to bring back
    assert HostOffload(model, None).offload([OPTIMIZER]) == 0  # a reference model has no optimizer


class _Worker(OffloadingWorker, TrainingWorker):
    pass


def _batch(rows: int = 6, seed: int = 0) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (4 + i % 3,), generator=gen).tolist() for i in range(rows)]
    responses = [torch.randint(5, 500, (2 + i % 4,), generator=gen).tolist() for i in range(rows)]
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    advantages = torch.randn(rows, 1, generator=gen).expand(-1, batch.response_len) * batch.response_mask
    return batch.with_extras(advantages=advantages.contiguous())


def test_worker_brings_its_sharded_state_back_before_using_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """FSDP2 (DTensor parameters, gloo world of 1): two steps with the state offloaded between them
    give the weights of two steps without, and reads (weights for a sync, a checkpoint) leave the
    state where it was."""
    batch = _batch()
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    results = []
    for i, cls in enumerate((TrainingWorker, _Worker)):
        settings = WorkerSettings(
            model_path=str(tiny_model_dir),
            fsdp=True,
            optimizer=OptimizerSettings(OptimizerConfig(lr=1e-2, weight_decay=0.0)),
        )
        w = cls(settings, init_method=f"file://{tmp_path / f'rdzv{i}'}")
        w.setup()
        w.train_mini_batch(batch, objective, micro_batch_size=3)
        if isinstance(w, _Worker):
            figures = w.offload_to_host()
            assert figures["offloaded_gib"] > 0 and w.offloaded_parts() == [MODEL, OPTIMIZER]
            weights = dict(w.iter_full_weights())  # read on the device, then back to the host
            assert w.offloaded_parts() == [MODEL, OPTIMIZER]
            w.save_checkpoint(str(tmp_path / "ckpt"))
            assert w.offloaded_parts() == [MODEL, OPTIMIZER]
            w.offload_to_host([OPTIMIZER])  # already there: nothing moves
        w.train_mini_batch(batch, objective, micro_batch_size=3)  # brings everything back first
        if isinstance(w, _Worker):
            assert w.offloaded_parts() == []
            assert weights.keys() == dict(w.iter_full_weights()).keys()
        results.append({k: v.clone() for k, v in w.iter_full_weights()})
        w.shutdown()
    for name, want in results[0].items():
        assert torch.equal(results[1][name], want), name
