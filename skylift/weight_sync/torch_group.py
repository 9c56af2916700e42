"""Joining a weight-update group that the trainer built with torch.distributed's own group helper.

A trainer that speaks the per-tensor protocol (`WeightUpdateGroupSpec.protocol`) creates its side
of the group the way `torch.distributed` lays a process group out on a store: a `tcp://`
rendezvous in which rank 0 hosts the `TCPStore` and waits for every other rank to register, a
`PrefixStore(group_name, store)`, and then torch's process-group helper, which adds its own
prefixes: `"<group_name>/"` for the group and `"<device>/"` for its backend, the first device
the backend serves (`cpu` for gloo, `cuda` for nccl; when one backend serves every device torch
creates it once). There is no handshake broadcast.

`torch_layout_stores` lays out the engine side of exactly that layout from bare store and
backend objects (no global torch.distributed state in the vLLM worker), so the two meet:
`process_group.create_weight_sync_group(..., layout="torch")` joins it.

skylift's own sender uses the simpler layout of `process_group.create_weight_sync_group`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

#: The device whose prefix torch's helper gives the (single) backend of each kind.
_BACKEND_DEVICE: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}


def torch_layout_stores(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str
) -> Callable[[timedelta], tuple[dist.Store, dist.Store]]:
    """`stores(timeout)`: (the TCP store of the trainer's `tcp://master_address:master_port`
    rendezvous, the store torch's helper keys the group's `backend` under)."""

    def stores(timeout: timedelta) -> tuple[dist.Store, dist.Store]:
        # wait_for_workers=True makes this client register with the store, which the trainer's
        # rank 0 (hosting it) waits for before its rendezvous returns.
        tcp = dist.TCPStore(
            master_address, master_port, world_size, is_master=False, timeout=timeout, wait_for_workers=True
        )
        group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, tcp))
        return tcp, dist.PrefixStore(f"{_BACKEND_DEVICE[backend]}/", group_store)

    return stores
