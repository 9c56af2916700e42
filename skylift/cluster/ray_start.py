"""Ray for a run: join the cluster (`trainer.ray_address` / `RAY_ADDRESS`) or start one on
loopback, pass the driver's environment on to workers and engines, and reserve the run's
placement groups."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from skylift.config.schema import SkyliftConfig

#: Environment variables the driver passes on to Ray workers and engines.
RAY_WORKER_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_HOST_IP",
    "GLOO_SOCKET_IFNAME",
    "SKYLIFT_CACHE_DIR",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "VLLM_LOGGING_LEVEL",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "PYTHONWARNINGS",
    "SKYLIFT_RUNS_DIR",
)


#: Settings that describe one host only: not passed on to the nodes of a joined cluster.
HOST_ONLY_ENV = ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME")


def ray_address(configured: str | None) -> str | None:
    """The cluster to join: `trainer.ray_address`, else `RAY_ADDRESS`, else None (start a local
    Ray of the run's own). ``local`` in either means a local Ray too."""
    address = configured or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def ray_worker_env(joining: bool) -> dict[str, str]:
    """Environment variables for Ray workers and engines (host-specific ones only on one host)."""
    env = {k: os.environ[k] for k in RAY_WORKER_ENV if k in os.environ}
    if joining:
        for key in HOST_ONLY_ENV:
            env.pop(key, None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # engine start-up chatter would drown the progress
    return env


def init_ray(address: str | None = None, min_cpus: float = 0, object_store_gb: float = 0.5) -> bool:
    """Join the Ray cluster at `address` (or `RAY_ADDRESS`); without one, start a local Ray of
    this run's own on loopback, even when another Ray runs on this machine (`ray start --head`
    there would otherwise be joined, and refuse the local resources asked for).

    A local Ray gets at least `min_cpus` logical CPUs (what the run's placement groups ask for)
    and an object store of `object_store_gb` GiB.
    Returns True when this call connected (the caller then calls `ray.shutdown()`).
    """
    import ray

    if ray.is_initialized():
        return False
    address = ray_address(address)
    if address:
        # connecting: the cluster's nodes bring their own resources; none may be given here
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": ray_worker_env(True)})
        return True
    ray.init(
        address="local",  # not "the cluster last started on this machine", Ray's default
        num_cpus=int(max(2, os.cpu_count() or 2, math.ceil(min_cpus))),
        include_dashboard=False,
        log_to_driver=True,
        object_store_memory=int(object_store_gb * (1 << 30)),
        runtime_env={"env_vars": ray_worker_env(False)},
        _node_ip_address="127.0.0.1",
    )
    return True


def ray_cluster_line(joined: bool) -> str:
    """What the connected Ray sees and how this run got it: `Ray cluster ADDR (joined): 2
    node(s): 10.0.0.1 {CPU: 8, GPU: 4}, ...` (RAY_ADDRESS or trainer.ray_address) or `Ray cluster
    ADDR (started locally for this run; no RAY_ADDRESS or trainer.ray_address to join): ...`."""
    import ray

    from skylift.cluster.placement import cluster_nodes, describe_cluster

    ctx = ray.get_runtime_context()
    gcs = getattr(ctx, "gcs_address", None) or "?"
    how = (
        "joined" if joined else "started locally for this run; no RAY_ADDRESS or trainer.ray_address to join"
    )
    return f"Ray cluster {gcs} ({how}): {describe_cluster(cluster_nodes())}"


@dataclasses.dataclass
class RayRun:
    """A run's Ray: whether this process connected (and must disconnect), its placement groups and
    what to tell the user about them."""

    started: bool
    placement: Any  # PlacedGroups
    lines: list[str]


def start_ray_run(cfg: SkyliftConfig, training: bool = True) -> RayRun:
    """Join (or start) Ray and reserve the run's placement groups (`training=False`: the engines'
    only); the lines say which cluster was joined, what it has and where each group landed. Fails
    within `trainer.placement.timeout_s` when the cluster cannot hold the request (the message has
    both sides)."""
    import time

    import ray

    from skylift.cluster.gpu_sharing import driver_without_gpus, shared_placement
    from skylift.cluster.placement import (
        PlacedGroups,
        PlacementError,
        cluster_nodes,
        plan_placement,
        request_from_config,
    )

    started_at = time.perf_counter()
    address = ray_address(cfg.trainer.ray_address)
    gpu = torch.cuda.is_available()
    request = request_from_config(cfg, gpu=gpu)
    if not training:
        request = dataclasses.replace(request, with_policy=False, with_ref=False, with_critic=False)
    plan = plan_placement(request)
    started = init_ray(
        address, min_cpus=plan.total().get("CPU", 0.0), object_store_gb=cfg.trainer.ray_object_store_gb
    )
    lines = [ray_cluster_line(joined=bool(address))]
    nodes = cluster_nodes()
    if (refusal := driver_without_gpus(address, gpu, nodes)) is not None:
        if started:
            ray.shutdown()
        raise PlacementError(refusal)
    # one machine with fewer GPUs than bundles: they share its GPUs
    plan, shared = shared_placement(request, nodes, joined=bool(address))
    if shared is not None:
        lines.append(shared.line)
    try:
        placement = PlacedGroups(plan, cfg.trainer.placement.timeout_s)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    lines.append(
        f"placement: {placement.layout()} (ready in {time.perf_counter() - started_at:.1f} s with Ray start-up)"
    )
    return RayRun(started=started, placement=placement, lines=lines)
