"""`weight_sync.broadcast.direct_load`: its building blocks on plain torch modules, and the receivers'
one load path (`load_direct_then_reload`) over a recording worker (the loads into a real vLLM
model, bit for bit against vLLM's reload, are in tests/integration/test_weight_sync_local.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

from skylift.weight_sync.broadcast.direct_load import (
    DirectLoader,
    _adjacent,
    _restore_kernel_tensors,
    load_direct_then_reload,
)
from skylift.weight_sync.broadcast.fused_staging import LoadUnits
from skylift.weight_sync.buckets import BufferArena, Piece, bucket_of, unpack_bucket, wire_pieces


def loader(model: torch.nn.Module | None = None) -> DirectLoader:
    model = model or torch.nn.Linear(2, 2)
    return DirectLoader(model, LoadUnits.from_model(model))


def received(parts: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`parts` as the stream's receiver holds them: views of one flat buffer per dtype."""
    bucket, pieces = wire_pieces(parts, BufferArena(torch.device("cpu")))
    flat = [
        torch.cat([p.reshape(-1) for p in pieces if p.dtype == d])
        for d in dict.fromkeys(p.dtype for p in pieces)
    ]
    return unpack_bucket(bucket_of(parts), flat)


def test_parts_side_by_side_are_one_view_of_the_buffer() -> None:
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    views = [t for _, t in received([("q", q), ("k", k), ("v", v)])]
    assert _adjacent(views)
    fused = loader()._fused(views, torch.float32)
    assert torch.equal(fused, torch.cat([q, k, v]))
    assert fused.data_ptr() == views[0].data_ptr()  # no copy
    fused[0, 0] = 123.0
    assert views[0][0, 0].item() == 123.0


def test_parts_apart_or_of_another_dtype_are_copied_into_reused_scratch() -> None:
    direct = loader()
    gate, up = torch.randn(3, 2), torch.randn(5, 2)
    assert not _adjacent([gate, up])
    first = direct._fused([gate, up], torch.float32)
    assert torch.equal(first, torch.cat([gate, up]))
    assert first.data_ptr() not in (gate.data_ptr(), up.data_ptr())
    ptr = first.data_ptr()
    del first
    again = direct._fused([gate.to(torch.bfloat16), up.to(torch.bfloat16)], torch.float32)
    assert again.data_ptr() == ptr  # the scratch memory, reused once the previous view is gone
    assert torch.equal(again, torch.cat([gate, up]).to(torch.bfloat16).float())
    held = again
    other = direct._fused([up, gate], torch.float32)
    assert other.data_ptr() != held.data_ptr()  # a view still alive is never overwritten
    assert torch.equal(held, torch.cat([gate, up]).to(torch.bfloat16).float())


def test_views_of_different_buffers_are_not_adjacent() -> None:
    a, b = torch.randn(6), torch.randn(6)
    assert _adjacent([a[:3], a[3:]])
    assert not _adjacent([a[3:], a[:3]])  # out of order
    assert not _adjacent([a[:3], b[:3]])


def test_original_parameters_are_put_back_holding_the_processed_values() -> None:
    module = torch.nn.Linear(3, 2)
    original = {"weight": module.weight, "bias": module.bias}
    module.weight = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)
    module.bias = torch.nn.Parameter(torch.full((2,), 7.0), requires_grad=False)
    _restore_kernel_tensors(module, original)
    assert module.weight is original["weight"] and module.bias is original["bias"]
    assert torch.equal(module.weight.detach(), torch.ones(2, 3))
    assert torch.equal(module.bias.detach(), torch.full((2,), 7.0))


def test_a_processed_parameter_of_another_shape_is_an_error() -> None:
    module = torch.nn.Linear(3, 2)
    original = {"weight": module.weight}
    module.weight = torch.nn.Parameter(torch.ones(4, 3), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"Linear.weight: processing left shape \(4, 3\).*\(2, 3\)"):
        _restore_kernel_tensors(module, original)


def test_plain_torch_modules_and_unknown_names_are_left_to_vllms_reload() -> None:
    pytest.importorskip("vllm")
    from skylift.weight_sync.protocol import WeightBucket

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    direct = loader(model)
    assert direct.plan(WeightBucket(["0.weight", "0.bias"], ["float32"] * 2, [[2, 3], [2]])) is None
    assert direct.plan(WeightBucket(["missing.weight"], ["float32"], [[2, 3]])) is None


class PlanningLoader:
    """Maps every bucket whose names all start with "direct." (what `DirectLoader.plan` does for
    the modules it knows); records what it loads."""

    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def plan(self, bucket: Any) -> list[str] | None:
        return list(bucket.names) if all(n.startswith("direct.") for n in bucket.names) else None

    def load(self, loads: list[str], tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.log.append(("direct", tuple(n for n, _ in tensors)))


class LoadingWorker:
    """The loading helpers of `broadcast.receiver.WeightSyncWorkerExtension`, recording calls."""

    def __init__(self, direct: bool = True) -> None:
        self.log: list[tuple] = []
        self.loader = PlanningLoader(self.log) if direct else None

    def _skylift_direct_loader(self) -> PlanningLoader | None:
        return self.loader

    @contextlib.contextmanager
    def _skylift_loading(self) -> Iterator[None]:
        self.log.append(("enter",))
        yield
        self.log.append(("exit",))

    def _skylift_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, _ in weights:  # pulled one by one, as vLLM's reload does
            self.log.append(("reload", name))

    def _skylift_reset_runner_caches(self) -> None:
        self.log.append(("reset",))


def pieces(names: list[list[str]], log: list[tuple]) -> Iterator[Piece]:
    """One piece per list of names; `log` records when each is produced (a receiver's waiting)."""
    for group in names:
        log.append(("arrived", group[0]))
        named = [(n, torch.zeros(1)) for n in group]
        yield bucket_of(named), named


def test_direct_until_a_piece_is_refused_then_one_reload_pulls_the_rest_as_it_arrives() -> None:
    worker = LoadingWorker()
    names = [["direct.a"], ["direct.b"], ["other.c"], ["direct.d", "direct.e"]]
    assert load_direct_then_reload(worker, pieces(names, worker.log)) == (2, True)
    assert worker.log == [
        ("enter",),
        ("arrived", "direct.a"),
        ("direct", ("direct.a",)),
        ("arrived", "direct.b"),
        ("direct", ("direct.b",)),
        ("arrived", "other.c"),
        ("reload", "other.c"),  # the refused piece and every later one: one reload ...
        ("arrived", "direct.d"),  # ... that takes each piece only when it has arrived
        ("reload", "direct.d"),
        ("reload", "direct.e"),
        ("exit",),
    ]  # no cache reset: vLLM's reload does its own


def test_an_all_direct_load_resets_the_caches_and_no_loader_means_one_reload() -> None:
    worker = LoadingWorker()
    assert load_direct_then_reload(worker, pieces([["direct.a"], ["direct.b"]], worker.log)) == (2, False)
    assert worker.log[-2:] == [("reset",), ("exit",)]
    plain = LoadingWorker(direct=False)
    assert load_direct_then_reload(plain, pieces([["direct.a"], ["direct.b"]], plain.log)) == (0, True)
    assert [e for e in plain.log if e[0] == "reload"] == [("reload", "direct.a"), ("reload", "direct.b")]
    empty = LoadingWorker()
    assert load_direct_then_reload(empty, iter([])) == (0, False)
    assert ("reset",) not in empty.log
