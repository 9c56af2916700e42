"""Buckets of named tensors: how a state dict is cut, packed for the wire, and unpacked.

Wire format (see `skylift.weight_sync.protocol.WeightBucket`): for each distinct dtype in order of
first appearance, ONE contiguous 1-D tensor holding that dtype's tensors flattened and
concatenated in list order. Sender and receiver derive the buffer sizes from the metadata alone.

Bucketing never splits a *load unit*: all tensors of one transformer block (names up to their
first numeric component, e.g. ``model.layers.3``) travel in the same bucket. vLLM reloads a bucket
layer by layer and fuses Hugging Face tensors into one kernel (q/k/v -> qkv_proj, gate/up ->
gate_up_proj, all experts -> one MoE weight); a fused layer that receives only some of its parts
in one reload is rebuilt with uninitialised memory for the others. A unit larger than the bucket
bound gets a bucket of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from skylift.utils.dtypes import dtype_to_str, str_to_dtype
from skylift.weight_sync.protocol import WeightBucket

NamedTensor = tuple[str, torch.Tensor]
Piece = tuple[WeightBucket, list[NamedTensor]]
"""A bucket's metadata (what `broadcast.direct_load` plans from) and its tensors, as a receiver loads it."""


def load_unit(name: str) -> str:
    """The group of tensors that must be loaded together: the prefix up to the first numeric
    component (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``), else the parent
    module (``model.norm.weight`` -> ``model.norm``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor occupies on the wire."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Cut a stream of named tensors into buckets of at most `bucket_bytes` bytes each.

    Consecutive tensors of one load unit stay together; a unit bigger than `bucket_bytes` forms
    a bucket of its own. Streams: at most one bucket plus one unit are held at a time.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    bucket_size = 0
    unit: list[NamedTensor] = []
    unit_size = 0
    unit_key: str | None = None

    def add_unit() -> Iterator[list[NamedTensor]]:
        nonlocal bucket, bucket_size
        if bucket and bucket_size + unit_size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.extend(unit)
        bucket_size += unit_size
        if bucket_size >= bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0

    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the state dict")
        seen.add(name)
        key = load_unit(name)
        if key != unit_key and unit:
            yield from add_unit()
            unit, unit_size = [], 0
        unit_key = key
        unit.append((name, tensor))
        unit_size += tensor_nbytes(tensor)
    if unit:
        yield from add_unit()
    if bucket:
        yield bucket


def dtype_order(dtypes: Sequence[str]) -> list[str]:
    """Distinct dtypes in order of first appearance: the order of the flat buffers on the wire."""
    return list(dict.fromkeys(dtypes))


def validate_bucket(bucket: WeightBucket) -> WeightBucket:
    """The bucket with normalized dtype names (``torch.bfloat16`` -> ``bfloat16``); ValueError
    naming the fault when the metadata is inconsistent (lengths, names, dtypes, shapes).

    The one check of both ends: the server answers 400 with its message, the receiver refuses."""
    names, n = bucket.names, len(bucket.names)
    if len(bucket.dtypes) != n or len(bucket.shapes) != n:
        raise ValueError(
            f"bucket metadata lengths differ: names, dtypes and shapes must have the same length, "
            f"got {n}, {len(bucket.dtypes)} and {len(bucket.shapes)}"
        )
    if n == 0:
        raise ValueError("empty bucket: 'names' must hold at least one tensor name")
    if len(set(names)) != n:
        dup = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"duplicate tensor names in bucket: {dup[:5]}")
    dtypes = []
    for name, dtype, shape in zip(names, bucket.dtypes, bucket.shapes, strict=True):
        if not name:
            raise ValueError("tensor names must be non-empty")
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            raise ValueError(
                f"tensor {name!r} has an invalid shape {shape!r} (a negative dimension or not an integer)"
            )
        try:
            dtypes.append(dtype_to_str(str_to_dtype(dtype)))
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
    return WeightBucket(names=list(names), dtypes=dtypes, shapes=[list(s) for s in bucket.shapes])


def bucket_of(named_tensors: Sequence[NamedTensor]) -> WeightBucket:
    """The wire metadata (names, dtypes, shapes) of `named_tensors`, in their order."""
    return WeightBucket(
        names=[name for name, _ in named_tensors],
        dtypes=[dtype_to_str(t.dtype) for _, t in named_tensors],
        shapes=[list(t.shape) for _, t in named_tensors],
    )


def buffer_numels(bucket: WeightBucket) -> dict[str, int]:
    """Number of elements of each flat buffer, keyed by dtype name, in wire order."""
    sizes = {dtype: 0 for dtype in dtype_order(bucket.dtypes)}
    for dtype, shape in zip(bucket.dtypes, bucket.shapes, strict=True):
        sizes[dtype] += math.prod(shape)
    return sizes


def pack_bucket(
    named_tensors: Sequence[NamedTensor], device: torch.device | None = None
) -> tuple[WeightBucket, list[torch.Tensor]]:
    """Metadata and flat wire buffers (one per dtype, in wire order) for a bucket of tensors.

    Buffers are created on `device` (default: the device of the bucket's first tensor).
    """
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    device = device or named_tensors[0][1].device
    bucket = bucket_of(named_tensors)
    buffers = []
    for dtype in dtype_order(bucket.dtypes):
        parts = [t.detach().reshape(-1) for _, t in named_tensors if dtype_to_str(t.dtype) == dtype]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        buffers.append(flat.to(device))
    return bucket, buffers


def allocate_buffers(bucket: WeightBucket, device: torch.device) -> list[torch.Tensor]:
    """Empty receive buffers for a bucket, one per dtype, in wire order."""
    return [
        torch.empty(numel, dtype=str_to_dtype(dtype), device=device)
        for dtype, numel in buffer_numels(bucket).items()
    ]


def unpack_bucket(bucket: WeightBucket, buffers: Sequence[torch.Tensor]) -> list[NamedTensor]:
    """Split wire buffers back into named tensors (views into the buffers, in list order)."""
    order = dtype_order(bucket.dtypes)
    if len(buffers) != len(order):
        raise ValueError(f"bucket has {len(order)} dtypes ({order}) but {len(buffers)} buffers came")
    expected = buffer_numels(bucket)
    offsets: dict[str, int] = {}
    by_dtype: dict[str, torch.Tensor] = {}
    for dtype, buf in zip(order, buffers, strict=True):
        if buf.dtype != str_to_dtype(dtype) or buf.dim() != 1 or buf.numel() != expected[dtype]:
            raise ValueError(
                f"buffer for {dtype} is {buf.dtype} with shape {tuple(buf.shape)}, "
                f"expected 1-D {dtype} of {expected[dtype]} elements"
            )
        by_dtype[dtype] = buf
        offsets[dtype] = 0
    out: list[NamedTensor] = []
    for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
        numel = math.prod(shape)
        start = offsets[dtype]
        out.append((name, by_dtype[dtype][start : start + numel].view(shape)))
        offsets[dtype] = start + numel
    return out


_ALIGN = 64  # bytes between the per-dtype buffers of an arena (any dtype's element size divides it)


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share `tensor`'s memory; None if torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return int(use_count(tensor.untyped_storage()._cdata))


class BufferArena:
    """Memory for the flat wire buffers of one bucket at a time, kept from bucket to bucket.

    Fresh buffers for every bucket cost a page fault per page on CPU (about as much as the copy
    itself); an arena is touched once and reused. Its memory is reused only while no view of the
    previous bucket is alive (e.g. a tensor vLLM still holds for a module it has not completed):
    otherwise the arena takes new memory and leaves the old to those views.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._memory: torch.Tensor | None = None
        self._users: int | None = None  # storage users of the bare arena

    @property
    def nbytes(self) -> int:
        return 0 if self._memory is None else self._memory.numel()

    def _reusable(self, total: int) -> bool:
        if self._memory is None or self._memory.numel() < total:
            return False
        return self._users is not None and _storage_users(self._memory) == self._users

    def buffers(self, bucket: WeightBucket) -> list[torch.Tensor]:
        """Views of this arena, one 1-D buffer per dtype of `bucket` in wire order (contents are
        whatever the previous bucket left)."""
        return self.take([(str_to_dtype(dtype), numel) for dtype, numel in buffer_numels(bucket).items()])

    def take(self, sizes: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
        """Views of this arena, one 1-D buffer of each `(dtype, numel)` in order (contents are
        whatever the previous use left); the views of the previous use are given up."""
        layout = []
        total = 0
        for torch_dtype, numel in sizes:
            nbytes = numel * torch_dtype.itemsize
            layout.append((torch_dtype, total, numel, nbytes))
            total += -(-nbytes // _ALIGN) * _ALIGN
        if not self._reusable(total):
            self._memory = None
            self._memory = torch.empty(total, dtype=torch.uint8, device=self.device)
            self._users = _storage_users(self._memory)
        memory = self._memory
        assert memory is not None
        return [memory[start : start + nbytes].view(dtype) for dtype, start, numel, nbytes in layout]

    def release(self) -> None:
        """Drop the memory (views still alive keep theirs)."""
        self._memory = None


#: A tensor of at least this many bytes goes on the wire as it is, in a broadcast of its own; the
#: smaller ones between two such are copied together into one piece (on loopback gloo one more
#: broadcast costs about as much as copying a megabyte).
DIRECT_BYTES = 1 << 20


def wire_pieces(
    named_tensors: Sequence[NamedTensor], arena: BufferArena, direct_bytes: int | None = None
) -> tuple[WeightBucket, list[torch.Tensor]]:
    """A bucket's metadata and the 1-D pieces it goes on the wire in: its per-dtype flat buffers
    (wire format of `WeightBucket`) cut into consecutive pieces, in wire order.

    A contiguous tensor of at least `direct_bytes` (None: `DIRECT_BYTES`) on the arena's device is a piece as it is (a
    view: no copy); each run of other tensors of one dtype between two such is copied into one
    piece of `arena`. A receiver receives every piece straight into its slice of the flat buffers
    (`split_pieces` with the pieces' sizes)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    direct_bytes = DIRECT_BYTES if direct_bytes is None else direct_bytes
    bucket = bucket_of(named_tensors)
    plan: list[torch.Tensor | list[torch.Tensor]] = []  # a direct piece, or a run to copy
    for dtype in dtype_order(bucket.dtypes):
        run: list[torch.Tensor] = []
        for (_, tensor), tensor_dtype in zip(named_tensors, bucket.dtypes, strict=True):
            if tensor_dtype != dtype:
                continue
            flat = tensor.detach().reshape(-1)
            if (
                tensor.device == arena.device
                and tensor.is_contiguous()
                and tensor_nbytes(tensor) >= direct_bytes
            ):
                if run:
                    plan.append(run)
                    run = []
                plan.append(flat)
            elif flat.numel():
                run.append(flat)
        if run:
            plan.append(run)
    runs = [p for p in plan if isinstance(p, list)]
    memory = iter(arena.take([(r[0].dtype, sum(t.numel() for t in r)) for r in runs]))
    pieces = []
    for part in plan:
        if isinstance(part, list):
            buf = next(memory)
            torch.cat([t.to(arena.device) for t in part], out=buf)
            pieces.append(buf)
        else:
            pieces.append(part)
    return bucket, pieces


def split_pieces(buffers: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of `buffers` (the flat buffers of a bucket, in wire order) cut into consecutive pieces
    of `sizes` elements, as `wire_pieces` cut them; ValueError when the sizes do not tile the
    buffers exactly (a piece across two buffers, too few or too many elements)."""
    views = []
    pieces = iter(sizes)
    for buf in buffers:
        offset = 0
        while offset < buf.numel():
            size = next(pieces, None)
            if size is None:
                raise ValueError(f"the pieces cover {sum(sizes)} elements, fewer than the bucket's buffers")
            if size <= 0 or offset + size > buf.numel():
                raise ValueError(
                    f"a piece of {size} elements at offset {offset} does not fit the {buf.dtype} buffer of "
                    f"{buf.numel()} elements"
                )
            views.append(buf[offset : offset + size])
            offset += size
    if next(pieces, None) is not None:
        raise ValueError(f"the pieces cover {sum(sizes)} elements, more than the bucket's buffers")
    return views
