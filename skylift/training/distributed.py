"""torch.distributed set-up for training workers (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime as dt
import os

import torch
import torch.distributed as dist

from skylift.utils.devices import default_backend


def init_training_group(rank: int, world_size: int, init_method: str, timeout_s: float = 300.0) -> None:
    """Join the training workers' process group (idempotent within a process).

    `init_method` is `file:///path` for workers on one machine (no socket is opened beyond
    loopback) or `tcp://host:port` across machines.
    """
    if dist.is_initialized():
        return
    if init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend=default_backend(),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
    )


def device_for_rank(rank: int) -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")
