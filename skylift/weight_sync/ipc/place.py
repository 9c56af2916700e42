"""Where this process runs, as the transport rule (`weight_sync.topology`) sees a rank: its host
(name and boot id), "cpu" or "cuda", and the physical GPU (its UUID, so that processes with different
CUDA_VISIBLE_DEVICES agree). The policy's rank 0 and every engine worker say it of themselves
(`ipc.policy_rank.SharedWeightsRank.weight_sync_place`, the IPC engine side's ``places``), so the
rule gets the devices the ranks are really on, whatever placement put them there.

JSON-ready (a dict), since an engine's answer crosses HTTP and Ray. torch and the standard
library only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

import torch

from skylift.weight_sync.topology import Place


def host_id() -> str:
    """This host as the rule compares hosts: its name, (Linux) the first 8 characters of the
    kernel's boot id, so that two machines that happen to share a host name (containers) differ,
    and the network namespace, so that containers with networks of their own and the multihost
    tests' simulated hosts (one kernel, a namespace each) count as hosts of their own."""
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f"{host}/{f.read().strip()[:8]}"
        return f"{host}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return host


def place_of(device: torch.device | str | None) -> dict[str, Any]:
    """{"host", "device", "gpu"} of a rank whose tensors live on `device` (None: CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    host = host_id()
    if device.type != "cuda":
        return {"host": host, "device": "cpu", "gpu": None}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"host": host, "device": "cuda", "gpu": str(torch.cuda.get_device_properties(index).uuid)}


def place_from_wire(wire: Mapping[str, Any]) -> Place:
    """The `Place` of a `place_of` answer (`ValueError` for anything else)."""
    try:
        device = wire["device"]
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}")
        return Place(str(wire["host"]), device, None if wire.get("gpu") is None else str(wire["gpu"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a place: {wire!r}") from exc
