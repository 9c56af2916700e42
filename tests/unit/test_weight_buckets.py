"""Bucketing, packing and unpacking of named tensors for weight sync (no process group)."""

from __future__ import annotations

import pytest
import torch

from skylift.inference.types import WeightBucket
from skylift.weight_sync.buckets import (
    allocate_buffers,
    buffer_numels,
    dtype_order,
    dtype_to_str,
    iter_buckets,
    load_unit,
    pack_bucket,
    str_to_dtype,
    tensor_nbytes,
    unpack_bucket,
    validate_bucket,
)


def _mixed_state_dict(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=gen)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=gen)),
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=gen).to(torch.float16)),
        ("model.layers.1.mlp.up_proj.weight", torch.randn(4, 8, generator=gen).to(torch.bfloat16)),
        ("model.layers.1.mlp.scalar", torch.tensor(3.5)),
        ("model.norm.weight", torch.randn(8, generator=gen)),
        ("lm_head.weight", torch.randn(16, 8, generator=gen)),
    ]


def test_pack_unpack_round_trip_mixed_dtypes() -> None:
    items = _mixed_state_dict()
    bucket, buffers = pack_bucket(items)
    assert bucket.names == [n for n, _ in items]
    assert bucket.dtypes == [dtype_to_str(t.dtype) for _, t in items]
    # one flat 1-D buffer per dtype, in order of first appearance
    assert [str(b.dtype) for b in buffers] == ["torch.float32", "torch.bfloat16", "torch.float16"]
    assert all(b.dim() == 1 for b in buffers)
    assert sum(tensor_nbytes(b) for b in buffers) == sum(tensor_nbytes(t) for _, t in items)

    # the receiver allocates from metadata alone, receives the bytes, then unpacks
    received = allocate_buffers(WeightBucket(**bucket.to_dict()), torch.device("cpu"))
    for dst, src in zip(received, buffers, strict=True):
        dst.copy_(src)
    out = unpack_bucket(bucket, received)
    assert [n for n, _ in out] == [n for n, _ in items]
    for (_, got), (_, want) in zip(out, items, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_wire_order_follows_first_appearance() -> None:
    assert dtype_order(["bfloat16", "float32", "bfloat16", "float16", "float32"]) == [
        "bfloat16",
        "float32",
        "float16",
    ]
    bucket = WeightBucket(
        names=["a", "b", "c"], dtypes=["bfloat16", "float32", "bfloat16"], shapes=[[2, 3], [4], [5]]
    )
    assert buffer_numels(bucket) == {"bfloat16": 11, "float32": 4}


def test_pack_handles_non_contiguous_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bucket, buffers = pack_bucket([("w.weight", base.t())])
    ((name, got),) = unpack_bucket(bucket, buffers)
    assert name == "w.weight" and torch.equal(got, base.t())


def test_bucket_size_bound_is_respected() -> None:
    items = [(f"model.layers.{i}.mlp.weight", torch.zeros(100)) for i in range(10)]  # 400 B each
    buckets = list(iter_buckets(items, bucket_bytes=1000))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert all(sum(tensor_nbytes(t) for _, t in b) <= 1000 for b in buckets)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]


def test_tensor_bigger_than_bucket_gets_its_own_bucket() -> None:
    items = [
        ("a.weight", torch.zeros(10)),
        ("b.weight", torch.zeros(10)),
        ("big.weight", torch.zeros(1000)),
        ("c.weight", torch.zeros(10)),
    ]
    buckets = list(iter_buckets(items, bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["a.weight", "b.weight"], ["big.weight"], ["c.weight"]]


def test_fused_parts_of_one_block_stay_together() -> None:
    # q/k/v (fused into qkv_proj by vLLM) must not be split across buckets
    items = [
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(40)),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(40)),
        ("model.layers.0.self_attn.v_proj.weight", torch.zeros(40)),
        ("model.layers.1.self_attn.q_proj.weight", torch.zeros(40)),
        ("model.norm.weight", torch.zeros(10)),
    ]
    buckets = [[n for n, _ in b] for b in iter_buckets(items, bucket_bytes=200)]
    assert buckets[0] == [n for n, _ in items[:3]]
    assert buckets[1] == ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]


def test_load_unit() -> None:
    assert load_unit("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert load_unit("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"
    assert load_unit("model.norm.weight") == "model.norm"
    assert load_unit("lm_head.weight") == "lm_head"


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        list(iter_buckets([("a.w", torch.zeros(1)), ("a.w", torch.zeros(1))], bucket_bytes=100))


def test_invalid_metadata_is_refused() -> None:
    with pytest.raises(ValueError, match="lengths differ"):
        validate_bucket(WeightBucket(names=["a", "b"], dtypes=["float32"], shapes=[[1], [2]]))
    with pytest.raises(ValueError, match="unknown dtype"):
        validate_bucket(WeightBucket(names=["a"], dtypes=["complex7"], shapes=[[1]]))
    with pytest.raises(ValueError, match="invalid shape"):
        validate_bucket(WeightBucket(names=["a"], dtypes=["float32"], shapes=[[-1]]))
    bucket = WeightBucket(names=["a"], dtypes=["float32"], shapes=[[4]])
    with pytest.raises(ValueError, match="expected 1-D float32 of 4"):
        unpack_bucket(bucket, [torch.zeros(5)])


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert str_to_dtype(dtype_to_str(dtype)) is dtype
    assert str_to_dtype("torch.bfloat16") is torch.bfloat16


@pytest.mark.parametrize("layout", ["skylift", "torch"])
def test_both_rendezvous_layouts_check_their_arguments_alike(layout: str) -> None:
    """Bad arguments are refused before any socket is opened, with the same messages."""
    import functools

    from skylift.weight_sync.process_group import WeightSyncError, create_weight_sync_group

    join = functools.partial(create_weight_sync_group, layout=layout)
    args = dict(master_address="127.0.0.1", master_port=1, group_name="g", timeout_s=1.0)
    with pytest.raises(WeightSyncError, match="unknown weight-sync backend 'mpi'"):
        join(rank=1, world_size=2, backend="mpi", **args)  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match=r"rank 2 is outside (0|1)\.\.1, .* world size 2"):
        join(rank=2, world_size=2, backend="gloo", **args)  # type: ignore[arg-type]
    if layout == "torch":  # an engine never hosts the group
        with pytest.raises(WeightSyncError, match=r"rank 0 is outside 1\.\.1"):
            join(rank=0, world_size=2, backend="gloo", **args)  # type: ignore[arg-type]


def test_buffer_arena_reuses_memory_only_when_no_view_is_left() -> None:
    from skylift.weight_sync.buckets import BufferArena, pack_bucket, wire_pieces

    arena = BufferArena(torch.device("cpu"))
    items = [
        ("model.layers.0.a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("model.layers.0.b", torch.arange(5, dtype=torch.bfloat16)),
        ("model.layers.0.c", torch.ones(3)),
        ("model.layers.0.d", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    bucket, buffers = wire_pieces(items, arena)
    ref_bucket, ref_buffers = pack_bucket(items)
    assert bucket == ref_bucket
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(buffers, ref_buffers, strict=True))
    first = buffers[0].data_ptr()
    kept = unpack_bucket(bucket, buffers)[0][1]  # a view someone (vLLM) still holds
    del buffers
    _, again = wire_pieces(items, arena)
    assert again[0].data_ptr() != first  # new memory: the held view keeps the old contents
    assert torch.equal(kept, items[0][1])
    ptr = again[0].data_ptr()
    del again, kept
    _, third = wire_pieces(items, arena)
    assert third[0].data_ptr() == ptr  # nothing held: the same memory again
    single = [("model.norm.weight", torch.ones(4))]
    assert wire_pieces(single, arena, direct_bytes=1)[1][0].data_ptr() == single[0][1].data_ptr()  # no copy


def test_wire_pieces_send_large_tensors_as_they_are_and_tile_the_flat_buffers() -> None:
    from skylift.weight_sync.buckets import BufferArena, pack_bucket, split_pieces, wire_pieces

    big = torch.arange(300, dtype=torch.float32)  # 1200 bytes: direct at direct_bytes=1024
    items = [
        ("model.layers.0.a", torch.ones(2, 3)),
        ("model.layers.0.b", torch.arange(5, dtype=torch.bfloat16)),
        ("model.layers.0.big", big),
        ("model.layers.0.c", torch.full((4,), 2.0)),
        ("model.layers.0.d", torch.full((3,), 3.0)),
        ("model.layers.0.t", torch.arange(400, dtype=torch.float32).reshape(20, 20).t()),  # not contiguous
        ("model.layers.0.e", torch.zeros(0)),
    ]
    bucket, pieces = wire_pieces(items, BufferArena(torch.device("cpu")), direct_bytes=1024)
    ref_bucket, ref_buffers = pack_bucket(items)
    assert bucket == ref_bucket
    # float32: [a], big as it is, [c, d, t copied], then bfloat16: [b]
    assert [p.numel() for p in pieces] == [6, 300, 407, 5]
    assert pieces[1].data_ptr() == big.data_ptr()  # no copy
    received = [torch.empty_like(b) for b in ref_buffers]
    for view, piece in zip(split_pieces(received, [p.numel() for p in pieces]), pieces, strict=True):
        view.copy_(piece)  # what the receiver's broadcast into each slice does
    assert all(torch.equal(a, b) for a, b in zip(received, ref_buffers, strict=True))
    with pytest.raises(ValueError, match="does not fit the torch.float32 buffer"):
        split_pieces(received, [6, 300, 400, 12])  # a piece across the two dtypes' buffers
    with pytest.raises(ValueError, match="more than the bucket's buffers"):
        split_pieces(received, [713, 5, 1])
    with pytest.raises(ValueError, match="fewer than the bucket's buffers"):
        split_pieces(received, [713])
