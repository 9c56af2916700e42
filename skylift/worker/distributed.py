"""torch.distributed set-up for training workers (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime as dt
import os

import torch
import torch.distributed as dist

from skylift.utils.devices import default_backend
from skylift.utils.network import interface_of, is_loopback, route_address


def tcp_init_method(master_addr: str, master_port: int) -> str:
    """The rendezvous of ranks on several hosts: rank 0's node IP (MASTER_ADDR) and a free port."""
    return f"tcp://{master_addr}:{int(master_port)}"


def _use_interface_towards(master_addr: str) -> None:
    """gloo binds the interface that reaches rank 0 (a `GLOO_SOCKET_IFNAME=lo` from one host would
    make a multi-host group unreachable)."""
    if is_loopback(master_addr):
        return
    local = route_address(master_addr)
    ifname = interface_of(local)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname


def init_training_group(rank: int, world_size: int, init_method: str, timeout_s: float = 300.0) -> None:
    """Join the training workers' process group (idempotent within a process).

    `init_method` is `file:///path` for workers on one machine (no socket is opened beyond
    loopback) or `tcp://host:port` across machines.
    """
    if dist.is_initialized():
        return
    if init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif init_method.startswith("tcp://"):
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
        _use_interface_towards(host)
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
