"""Joining a weight-update group that the trainer built with torch.distributed's own group helper.

SkyRL's trainer (`skyrl_train.distributed.utils.init_custom_process_group`) creates its side of the
group the way `torch.distributed` lays a process group out on a store: a `tcp://` rendezvous in
which rank 0 hosts the `TCPStore` and waits for every other rank to register, a
`PrefixStore(group_name, store)`, and then torch's process-group helper, which adds its own
prefixes: `"<group_name>/"` for the group and `"<device>/"` for its backend, the first device
the backend serves (`cpu` for gloo, `cuda` for nccl; when one backend serves every device torch
creates it once). There is no handshake broadcast.

`join_torch_layout_group` builds the engine side of exactly that layout from bare store and
backend objects (no global torch.distributed state in the vLLM worker), so the two meet.

skylift's own sender uses the simpler layout of `process_group.create_weight_sync_group`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from skylift.weight_sync.process_group import (
    Backend,
    WeightSyncError,
    WeightSyncGroup,
    check_group_args,
    group_device,
    new_backend,
)

#: The device whose prefix torch's helper gives the (single) backend of each kind.
_BACKEND_DEVICE: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}


def join_torch_layout_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: Backend,
    timeout_s: float,
    device: torch.device | None = None,
) -> WeightSyncGroup:
    """Join, as `rank` (>= 1), the group that rank 0 created with torch's group helper over a
    `tcp://master_address:master_port` rendezvous. Blocks until every rank has joined (both sides
    must run concurrently) or `timeout_s`."""
    check_group_args(backend, rank, world_size, first_rank=1)
    timeout = timedelta(seconds=timeout_s)
    where = (
        f"the trainer's group {group_name!r} at tcp://{master_address}:{master_port} "
        f"as rank {rank}/{world_size}"
    )
    device = group_device(backend, device if backend == "nccl" else None)
    try:
        # wait_for_workers=True makes this client register with the store, which the trainer's
        # rank 0 (hosting it) waits for before its rendezvous returns.
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=False, timeout=timeout, wait_for_workers=True
        )
        group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
        backend_store = dist.PrefixStore(f"{_BACKEND_DEVICE[backend]}/", group_store)
        pg = new_backend(backend_store, rank, world_size, backend, timeout, master_address, device)
        pg._set_sequence_number_for_group()
    except Exception as exc:
        raise WeightSyncError(f"could not join {where}: {exc}") from exc
    return WeightSyncGroup(
        group_name=group_name,
        backend=backend,
        rank=rank,
        world_size=world_size,
        device=device,
        timeout_s=timeout_s,
        process_group=pg,
        store=store,
    )
