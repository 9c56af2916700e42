"""FSDP2 sharding of a training worker's model: every decoder layer, then the root; over all ranks or
hybrid (shard groups replicated, `fsdp_config.fsdp_size`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def hybrid_mesh(world_size: int, fsdp_size: int, device_type: str) -> Any:
    """The device mesh of hybrid sharding (`fsdp_config.fsdp_size`): `world_size // fsdp_size` replicas,
    each sharded over `fsdp_size` consecutive ranks (dims "replicate", "shard"); None (shard over
    every rank) when `fsdp_size` is -1 or at least `world_size`. Needs the process group."""
    if fsdp_size < 0 or fsdp_size >= world_size:
        return None
    if fsdp_size == 0 or world_size % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size} must divide the {world_size} ranks of the worker group")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard")
    )


def shard_model(
    model: torch.nn.Module, *, reshard_after_forward: bool, cpu_offload: bool, mesh: Any = None
) -> None:
    """`fully_shard` each repeated transformer block, then the whole model.

    reshard_after_forward: True keeps torch's default (each layer's gathered parameters are freed
    after its forward; the root's are kept, its backward comes next); False keeps every layer's
    until backward, one all-gather fewer per layer for the memory of the full parameters.
    cpu_offload: sharded parameters, gradients and optimizer state live in host memory
    (`CPUOffloadPolicy`) on a GPU; a CPU worker holds them there already, so it changes nothing.
    mesh: a 2-D (replicate, shard) mesh for hybrid sharding (`hybrid_mesh`); None: all ranks shard.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options: dict[str, Any] = {} if reshard_after_forward else {"reshard_after_forward": False}
    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    if cpu_offload and on_gpu:
        options["offload_policy"] = CPUOffloadPolicy()
    if mesh is not None:
        options["mesh"] = mesh
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the unit FSDP shards on)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    return []


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Within: every FSDP2-sharded module of `model` holds its whole parameters (a collective:
    every rank all-gathers); resharded on leaving. A model without FSDP2 as it is."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a `DTensor`; a collective), detached; a plain one as it is."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
