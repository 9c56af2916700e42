"""The dtype vocabulary: torch dtypes by name, as configs and the weight-sync wire spell them."""

from __future__ import annotations

from collections.abc import Collection

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
#: the model dtypes a training worker holds parameters or computes in
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_to_str(dtype: torch.dtype) -> str:
    """The name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent (supported: {', '.join(DTYPES)})")
    return name


def str_to_dtype(name: str, allowed: Collection[str] = DTYPES.keys()) -> torch.dtype:
    """The torch dtype of a name (``"bfloat16"``, ``"torch.bfloat16"``; ``bf16``, ``fp16`` and
    ``fp32`` too) if it is one of `allowed`."""
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in allowed or key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (supported: {', '.join(allowed)})")
    return DTYPES[key]
