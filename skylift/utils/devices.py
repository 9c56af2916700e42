"""Which torch.distributed backend this process should use."""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["gloo", "nccl"]


def default_backend() -> Backend:
    """`nccl` when CUDA is available in this process, else `gloo`."""
    return "nccl" if torch.cuda.is_available() else "gloo"
