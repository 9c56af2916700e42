"""A local Ray on a machine with fewer GPUs than the run's GPU bundles: the bundles share its GPUs.

`start_ray_run` (`cluster.ray_start`) asks `gpu_share` before it reserves the placement groups:
a run started without a cluster to join, on a machine whose GPUs are fewer than the bundles the
placement plan asks for, gets bundles of a share of a GPU each (as actors without placement groups
would), and one line says so: what was asked, what the node has, and what that means for weight
sync (two ranks on one GPU: NCCL refuses them, the transport rule, `weight_sync.placed`, takes
CUDA IPC there from the GPUs the ranks report). A joined cluster short of GPUs is not shrunk: its
placement fails with what was asked and what it has (`cluster.placement.PlacedGroups`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skylift.cluster.placement import PlacementPlan, PlacementRequest, plan_placement


@dataclass(frozen=True)
class GpuShare:
    """Each GPU bundle's share of a GPU, and the line that says why."""

    share: float
    line: str


def gpu_share(needed: float, nodes: Sequence[Mapping[str, Any]], joined: bool) -> GpuShare | None:
    """`needed` GPU bundles on the cluster's `nodes` (`placement.cluster_nodes()`: "ip",
    "resources"): a `GpuShare` when a local Ray (not `joined`) has fewer GPUs, at least one, than
    bundles; else None (enough GPUs, no GPU, or a joined cluster)."""
    gpus = {str(n["ip"]): float(n["resources"].get("GPU", 0.0)) for n in nodes}
    have = sum(gpus.values())
    if joined or not 0 < have < needed:
        return None
    # Ray gives a bundle's fraction of a GPU from one GPU: a share must divide 1 (3 bundles of 2/3
    # on 2 GPUs never become ready, ray 2.60; of 1/2 they do)
    share = 1 / math.ceil(needed / have - 1e-9)
    where = ", ".join(f"{ip} has {n:g} GPU(s)" for ip, n in gpus.items() if n > 0)
    line = (
        f"fewer GPUs than GPU bundles: the placement asks for {needed:g} GPU bundle(s), and {where}; "
        f"the bundles share the GPUs ({share:.2f} GPU each), so ranks may share a GPU: weight sync "
        "takes CUDA IPC where the policy's rank 0 and an engine do (NCCL refuses two ranks on one GPU)"
    )
    return GpuShare(share, line)


def shared_placement(
    request: PlacementRequest, nodes: Sequence[Mapping[str, Any]], joined: bool
) -> tuple[PlacementPlan, GpuShare | None]:
    """The placement plan of `request` on the cluster's `nodes`: its GPU bundles each take a share
    of a GPU where `gpu_share` says they share a local Ray's GPUs (the share, else None)."""
    plan = plan_placement(request)
    shared = gpu_share(plan.total().get("GPU", 0.0), nodes, joined)
    if shared is not None:
        plan = plan_placement(dataclasses.replace(request, gpus_per_bundle=shared.share))
    return plan, shared


def driver_without_gpus(
    address: str | None, driver_cuda: bool, nodes: Sequence[Mapping[str, Any]]
) -> str | None:
    """The line refusing a run that starts on a machine without CUDA and joins a cluster with GPUs
    (a CPU-only head node): the run's bundles, GPU defaults and engines follow the devices of the
    machine it starts on, so it would train on CPU beside idle GPUs. None where that is not so."""
    gpus = sum(float(n["resources"].get("GPU", 0.0)) for n in nodes)
    if not address or driver_cuda or gpus <= 0:
        return None
    return (
        f"the Ray cluster at {address} has {gpus:g} GPU(s), and this machine, where the run starts, sees no "
        "CUDA device: the run's placement, GPU defaults and engines follow the machine it starts on, so it "
        "would train on CPU. Start it on a GPU node of the cluster (e.g. ray job submit "
        "--entrypoint-num-gpus 1 -- skylift train ...)"
    )
