"""How a changed tensor's XOR patch is laid out before zstd compresses it (`TensorRecord.encoding`).

A small step changes few elements of a tensor in the engines' dtype (one GRPO step at lr 1e-6
leaves ~96% of SmolLM2's bf16 weights bit for bit the same), so the patch is mostly zeros with a
nonzero element here and there. zstd on the plain patch (``xor``) spends most of its bytes on where
the zeros stop; ``sparse`` writes the positions and the values apart, which zstd compresses to about
half (measured by `benchmarks/delta_payload.py`):

    u64 count, u64 far            (little endian)
    count x u8                    gap before each nonzero element (255: look in the far gaps)
    far x u64                     the gaps of 255 or more, in order
    count x element bytes         the nonzero elements' bytes, plane by plane (every element's
                                  first byte, then every second byte, ...)

`encode_patch` picks ``sparse`` only when it is smaller than the patch itself, else ``xor``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

XOR, SPARSE = "xor", "sparse"
ENCODINGS = (XOR, SPARSE)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_HEADER = struct.Struct("<QQ")
_FAR = 255


def encode_patch(patch: torch.Tensor, element_size: int) -> tuple[str, bytes]:
    """(encoding, bytes) of an XOR patch (flat uint8) whose elements are `element_size` bytes."""
    int_dtype = _INT_OF_SIZE.get(element_size)
    if int_dtype is None or patch.numel() % element_size:
        return XOR, patch.numpy().tobytes()
    elements = patch.view(int_dtype)
    idx = torch.nonzero(elements).reshape(-1)
    if idx.numel() * (element_size + 1) + _HEADER.size >= patch.numel():  # not sparse enough to pay
        return XOR, patch.numpy().tobytes()
    gaps = torch.diff(idx, prepend=torch.tensor([-1])) - 1
    far = gaps[gaps >= _FAR]
    planes = elements[idx].contiguous().view(torch.uint8).reshape(-1, element_size).t().contiguous()
    return SPARSE, b"".join(
        (
            _HEADER.pack(idx.numel(), far.numel()),
            gaps.clamp(max=_FAR).to(torch.uint8).numpy().tobytes(),
            far.to(torch.int64).numpy().astype("<u8").tobytes(),
            planes.numpy().tobytes(),
        )
    )


def decode_patch(encoding: str, data: bytes, nbytes: int, element_size: int) -> torch.Tensor:
    """The XOR patch (flat uint8, `nbytes` long) that `encode_patch` wrote as (`encoding`, `data`);
    ValueError when `data` does not hold one."""
    if encoding == XOR:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if encoding != SPARSE:
        raise ValueError(f"unknown patch encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    int_dtype = _INT_OF_SIZE.get(element_size)
    if int_dtype is None or nbytes % element_size or len(data) < _HEADER.size:
        raise ValueError(
            f"a sparse patch of {len(data)} bytes cannot hold {nbytes} bytes of {element_size}-byte elements"
        )
    count, far = _HEADER.unpack_from(data)
    start = _HEADER.size
    end = start + count + 8 * far + count * element_size
    if len(data) != end or count > nbytes // element_size:
        raise ValueError(
            f"a sparse patch of {len(data)} bytes does not match its header ({count} elements, {far} far gaps)"
        )
    buffer = bytearray(data)
    gaps = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=start).to(torch.int64)
    far_gaps = np.frombuffer(buffer, dtype="<u8", count=far, offset=start + count) if far else None
    is_far = gaps == _FAR
    if int(is_far.sum()) != far:
        raise ValueError(f"a sparse patch names {int(is_far.sum())} far gaps, its header {far}")
    if far_gaps is not None:
        gaps[is_far] = torch.from_numpy(far_gaps.astype(np.int64))
    idx = torch.cumsum(gaps + 1, 0) - 1
    out = torch.zeros(nbytes // element_size, dtype=int_dtype)
    if count:
        if int(idx[-1]) >= out.numel():
            raise ValueError(f"a sparse patch writes element {int(idx[-1])} of {out.numel()}")
        planes = torch.frombuffer(
            buffer, dtype=torch.uint8, count=count * element_size, offset=start + count + 8 * far
        )
        out[idx] = planes.reshape(element_size, count).t().contiguous().reshape(-1).view(int_dtype)
    return out.view(torch.uint8)
