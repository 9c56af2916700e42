"""The sparse layout of delta patches (`weight_sync.delta.encoding`): round trips, the choice it
makes, and clear errors for bytes that do not hold a patch."""

from __future__ import annotations

import pytest
import torch

from skylift.weight_sync.delta.encoding import SPARSE, XOR, decode_patch, encode_patch


def _patch(dtype: torch.dtype, n: int, changed: int, seed: int = 0) -> torch.Tensor:
    """The XOR of a tensor with itself after `changed` elements moved (one far gap included)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(dtype)
    new = old.clone()
    where = torch.randperm(n - 1, generator=g)[: changed - 1].tolist() + [n - 1]  # the last: a far gap
    new[where] = (new[where].float() * 1.01 + 1e-3).to(dtype)
    return torch.bitwise_xor(old.view(torch.uint8), new.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_a_sparse_patch_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    patch = _patch(dtype, 5000, 40)
    size = torch.tensor([], dtype=dtype).element_size()
    encoding, data = encode_patch(patch, size)
    assert encoding == SPARSE and len(data) < patch.numel() // 4
    assert torch.equal(decode_patch(encoding, data, patch.numel(), size), patch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_patch_of_one_changed_element_round_trips(dtype: torch.dtype) -> None:
    patch = _patch(dtype, 3000, 1)
    size = torch.tensor([], dtype=dtype).element_size()
    encoding, data = encode_patch(patch, size)
    assert encoding == SPARSE
    assert torch.equal(decode_patch(encoding, data, patch.numel(), size), patch)


def test_a_dense_patch_stays_plain_and_round_trips() -> None:
    patch = _patch(torch.bfloat16, 1000, 900)
    encoding, data = encode_patch(patch, 2)
    assert encoding == XOR and data == patch.numpy().tobytes()
    assert torch.equal(decode_patch(encoding, data, patch.numel(), 2), patch)


def test_bytes_that_hold_no_sparse_patch_are_refused_clearly() -> None:
    _, data = encode_patch(_patch(torch.bfloat16, 5000, 40), 2)
    with pytest.raises(ValueError, match="does not match its header"):
        decode_patch(SPARSE, data[:-3], 10000, 2)
    with pytest.raises(ValueError, match="writes element"):
        decode_patch(SPARSE, data, 2000, 2)  # positions past the tensor's end
    with pytest.raises(ValueError, match="unknown patch encoding 'rle'"):
        decode_patch("rle", data, 10000, 2)
