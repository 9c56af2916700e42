"""The weight-update process group: one small torch.distributed group shared by both sides.

The trainer's rank 0 (the sender) and every inference-engine worker (the receivers) build the
same kind of group with `create_weight_sync_group`: a `TCPStore` hosted by rank 0, a
`PrefixStore` named after the group (so several groups can share a port safely), and a bare
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) on it. The group is never registered as
torch's default group, so it coexists with the trainer's own FSDP groups and vLLM's groups.

Creation is a rendezvous: every rank blocks until all `world_size` ranks have joined, then a
one-element handshake broadcast checks that the group works. Run it concurrently on both sides
(in a thread when called from asyncio), or it deadlocks until `timeout_s`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from skylift.utils.devices import Backend
from skylift.utils.network import route_address
from skylift.weight_sync.protocol import WeightBucket
from skylift.weight_sync.torch_group import torch_layout_stores

#: How the group's stores are laid out: skylift's own, or torch's group helper's
#: (`skylift.weight_sync.torch_group`).
Layout = Literal["skylift", "torch"]

_HANDSHAKE_VALUE = 12345.0

#: A key of a skylift-layout group's store: how many ranks said they are joining (rank 0 when it
#: hosts the group; each engine for its workers, from its control plane, before they join), so
#: engines ask their workers to join only once every rank is on its way
#: (`skylift.weight_sync.broadcast.rendezvous.await_every_rank`).
ANNOUNCED_KEY = "skylift/announced"


class WeightSyncError(RuntimeError):
    """A weight-update group could not be created, used or destroyed."""


def announce_ranks(store: dist.Store, group_name: str, ranks: int) -> int:
    """Add `ranks` (negative: take them back) to the count of group `group_name`'s ranks on their
    way; the count after."""
    return int(dist.PrefixStore(group_name, store).add(ANNOUNCED_KEY, ranks))


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _gloo_device(master_address: str) -> dist.ProcessGroupGloo.Device:
    """The gloo transport device: bound to the local address of the route to `master_address`.

    On one host that is 127.0.0.1 (the loopback device); across hosts it is this host's address on
    the interface that reaches the group's master (rank 0 itself gets its own address back), so
    a `GLOO_SOCKET_IFNAME` meant for another group (e.g. `lo`) cannot misdirect it.
    """
    try:
        local = route_address(master_address)
    except OSError as exc:
        raise WeightSyncError(f"weight-sync group: {exc}") from exc
    return dist.ProcessGroupGloo.create_device(hostname=local)


@dataclass
class WeightSyncGroup:
    """A live weight-update group as seen by one rank."""

    group_name: str
    backend: Backend
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    process_group: dist.ProcessGroup
    store: dist.Store = field(repr=False)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast `tensor` in place from rank `src`; blocks until done or `timeout_s`."""
        if tensor.device != self.device:
            raise WeightSyncError(
                f"group {self.group_name!r}: tensor is on {tensor.device}, the {self.backend} "
                f"group expects {self.device}"
            )
        work = self.process_group.broadcast([tensor], _broadcast_options(src))
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # torch raises RuntimeError/DistBackendError
            raise WeightSyncError(
                f"group {self.group_name!r} rank {self.rank}/{self.world_size}: broadcast of "
                f"{tensor.numel()} x {tensor.dtype} failed or timed out after {self.timeout_s}s: {exc}"
            ) from exc

    def destroy(self) -> None:
        """Shut the group down and release its sockets (idempotent)."""
        pg = self.process_group
        try:
            pg.shutdown()
        except Exception:  # shutdown is best effort; a dead peer must not block cleanup
            pass
        self.process_group = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def _broadcast_options(src: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def check_group_args(backend: str, rank: int, world_size: int, *, first_rank: int = 0) -> None:
    """`WeightSyncError` unless `backend` is gloo or nccl and `first_rank <= rank < world_size`
    (the one check of both rendezvous layouts; engines, which never host, pass `first_rank=1`)."""
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"unknown weight-sync backend {backend!r} (expected 'gloo' or 'nccl')")
    if not first_rank <= rank < world_size:
        raise WeightSyncError(
            f"rank {rank} is outside {first_rank}..{world_size - 1}, the ranks this side can take in a "
            f"group of world size {world_size}"
        )


def group_device(backend: Backend, device: torch.device | None) -> torch.device:
    """The device a group's tensors live on: `device`, else `cuda:<current>` (nccl) or cpu (gloo)."""
    if device is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def new_backend(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: Backend,
    timeout: timedelta,
    master_address: str,
    device: torch.device,
) -> dist.ProcessGroup:
    """A bare gloo (transport bound to the route to `master_address`) or NCCL process group on
    `store` (the one constructor of both rendezvous layouts)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [_gloo_device(master_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    torch.cuda.set_device(device)
    nccl_options = dist.ProcessGroupNCCL.Options()
    nccl_options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, nccl_options)


def create_weight_sync_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: Backend,
    timeout_s: float,
    device: torch.device | None = None,
    store: dist.Store | None = None,
    layout: Layout = "skylift",
) -> WeightSyncGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group; blocks until all ranks joined.

    `layout` "skylift": rank 0 hosts a `TCPStore` (`store`: one it already created, e.g. on port 0
    to learn a free port before telling the engines; else one on `master_port`) and a handshake
    broadcast checks the group. "torch": join, as rank >= 1, a group rank 0 created with torch's
    group helper (`weight_sync.torch_group`; no handshake). `device` defaults to `cuda:<current>`
    for nccl and `cpu` for gloo.
    """
    torch_layout = layout == "torch"
    check_group_args(backend, rank, world_size, first_rank=1 if torch_layout else 0)
    if torch_layout:
        where = f"the trainer's group {group_name!r} at tcp://{master_address}:{master_port}"
        stores = torch_layout_stores(master_address, master_port, world_size, group_name, backend)
        device = device if backend == "nccl" else None
    else:
        where = f"weight-sync group {group_name!r} at {master_address}:{master_port}"

        def stores(timeout: timedelta) -> tuple[dist.Store, dist.Store]:
            tcp = store or dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=(rank == 0),
                timeout=timeout,
                wait_for_workers=False,
            )
            return tcp, dist.PrefixStore(group_name, tcp)

    where += f" as rank {rank}/{world_size}"
    timeout = timedelta(seconds=timeout_s)
    device = group_device(backend, device)
    try:
        tcp, backend_store = stores(timeout)
        if rank == 0 and not torch_layout and store is None:  # engines wait for every rank; a
            backend_store.add(ANNOUNCED_KEY, 1)  # store passed in was counted by its host
        pg = new_backend(backend_store, rank, world_size, backend, timeout, master_address, device)
        if torch_layout:  # number the collectives as torch's group helper does
            pg._set_sequence_number_for_group()
    except Exception as exc:
        raise WeightSyncError(f"could not join {where}: {exc}") from exc
    group = WeightSyncGroup(group_name, backend, rank, world_size, device, timeout_s, pg, tcp)
    if torch_layout:
        return group
    probe = torch.full((1,), _HANDSHAKE_VALUE if rank == 0 else 0.0, device=device)
    try:
        group.broadcast(probe)
    except WeightSyncError as exc:
        group.destroy()
        raise WeightSyncError(f"handshake failed in {where}: {exc}") from exc
    if probe.item() != _HANDSHAKE_VALUE:
        group.destroy()
        raise WeightSyncError(f"handshake in {where} received {probe.item()}")
    return group


def receive_bucket(
    group: WeightSyncGroup | None, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> tuple[WeightBucket, list[torch.Tensor]]:
    """An engine worker's half of one bucket's broadcast: the validated bucket and its flat buffers
    (one per dtype) received from rank 0 of `group` (None: the worker joined no group)."""
    from skylift.weight_sync.buckets import allocate_buffers, validate_bucket

    if group is None:
        raise WeightSyncError(
            "no weight-update group on this worker: call init_weight_update_communicator first"
        )
    bucket = validate_bucket(WeightBucket(names=list(names), dtypes=list(dtypes), shapes=list(shapes)))
    buffers = allocate_buffers(bucket, group.device)
    for buffer in buffers:
        group.broadcast(buffer, src=0)
    return bucket, buffers
