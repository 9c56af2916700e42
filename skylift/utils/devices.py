"""The devices this process sees: whether CUDA is there, which torch.distributed backend to use."""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["gloo", "nccl"]


def default_backend() -> Backend:
    """`nccl` when CUDA is available in this process, else `gloo`."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (the devices skylift's GPU defaults are for)."""
    return torch.cuda.is_available()
