"""The dtype vocabulary shared by weight sync and the training worker."""

from __future__ import annotations

import pytest
import torch

from skylift.utils.dtypes import FLOAT_DTYPES, str_to_dtype


def test_short_names_and_the_torch_prefix_name_the_same_dtype() -> None:
    assert str_to_dtype("bf16") is str_to_dtype("torch.bfloat16") is torch.bfloat16
    assert str_to_dtype("fp16", FLOAT_DTYPES) is torch.float16
    assert str_to_dtype("fp32", FLOAT_DTYPES) is torch.float32


def test_a_name_outside_the_allowed_ones_is_refused_with_them_listed() -> None:
    assert str_to_dtype("float64") is torch.float64  # the wire carries it
    with pytest.raises(
        ValueError, match=r"unknown dtype 'float64' \(supported: float32, bfloat16, float16\)"
    ):
        str_to_dtype("float64", FLOAT_DTYPES)  # a worker's parameters may not be
