"""`weight_sync.broadcast.direct_load`: its building blocks on plain torch modules (the loads into a real vLLM
model, bit for bit against vLLM's reload, are in tests/integration/test_weight_sync_local.py)."""

from __future__ import annotations

import pytest
import torch

from skylift.weight_sync.broadcast.direct_load import DirectLoader, _adjacent, _restore_kernel_tensors
from skylift.weight_sync.broadcast.fused_staging import LoadUnits
from skylift.weight_sync.buckets import BufferArena, bucket_of, unpack_bucket, wire_pieces


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
