"""The Ray side of a worker group: where its ranks meet, how the driver waits for their calls,
and the concurrency group that lets the weight-update group's tear-down reach a busy rank 0.

A rank's actor runs its calls one at a time, in order (Ray's default group). One call must not
wait behind another: `close_weight_group` while rank 0's `join_weight_group` waits in the
rendezvous of a group an engine failed to join (dropping the store's server is what ends that
wait: `WeightBroadcaster.close`). It runs in its own concurrency group (`WEIGHT_CONTROL`, one
thread); every other call, training included, stays in the default group, serialized.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from skylift.cluster.placement import PlacedGroups, PlacementError

logger = logging.getLogger("skylift.cluster.worker_group")

#: The actors' concurrency group of the calls that must not queue behind a blocked one (only
#: `RLWorker.close_weight_group`); one thread, apart from the default group's.
WEIGHT_CONTROL = "weight_control"


def rank_actor_class(worker_cls: type, num_cpus: float, num_gpus: float) -> Any:
    """`worker_cls` as a Ray actor class with the `WEIGHT_CONTROL` concurrency group."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={WEIGHT_CONTROL: 1})(
        worker_cls
    )


class WorkerError(RuntimeError):
    """A training worker died or did not answer in time; names the worker, its rank and the call."""


def wait_for_ranks(refs: Sequence[Any], who: str, method: str, timeout_s: float) -> list[Any]:
    """Results of one Ray call per rank, in rank order, within `timeout_s` seconds.

    The first rank to fail fails the call at once (its peers may be blocked in a collective with
    it): a rank whose process died, or that does not finish in time, is a `WorkerError` naming
    it; an exception raised by the call itself propagates as it is.
    """
    import ray
    from ray.exceptions import RayActorError

    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for ref in pending:
                ray.cancel(ref, force=False)
            raise WorkerError(
                f"{who} rank(s) {sorted(rank_of[r] for r in pending)}: {method} did not finish within "
                f"{timeout_s:.0f} s (raise trainer.worker_timeout_s if the work is legitimately this slow)"
            )
        try:
            ray.get(ready[0])
        except RayActorError as exc:
            raise WorkerError(
                f"{who} rank {rank_of[ready[0]]}: its process died during {method}: {exc}"
            ) from exc
    return ray.get(list(refs))


def file_rendezvous(name: str) -> str:
    return "file://" + os.path.join(tempfile.mkdtemp(prefix=f"skylift-{name}-"), "rendezvous")


def _free_port_on_node() -> tuple[str, int]:
    """(node IP, a TCP port free on it a moment ago), run on the node that will host rank 0."""
    import socket

    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return ip, int(sock.getsockname()[1])


def rendezvous(name: str, placement: PlacedGroups, role: str, node_ips: Sequence[str]) -> str:
    """file:// when every rank is on the driver's node, else tcp://<rank 0's node IP>:<free port>."""
    import ray

    from skylift.worker.distributed import tcp_init_method

    here = ray.util.get_node_ip_address()
    if all(ip == here for ip in node_ips):
        return file_rendezvous(name)
    options = placement.options(role, 0)
    options.update(num_cpus=0, num_gpus=0)
    options.pop("resources", None)
    probe = ray.remote(_free_port_on_node).options(**options).remote()
    ip, port = ray.get(probe, timeout=60)
    logger.info("%s: %d ranks on %s meet at %s:%d", name, len(node_ips), sorted(set(node_ips)), ip, port)
    return tcp_init_method(ip, port)


# ------------------------------------------------ ranks of one NCCL group on GPUs of their own


def _node_and_gpus() -> tuple[str, list[str]]:
    """(node IP, the GPU ids Ray gave this task), run in a rank's slot."""
    import ray

    return ray.util.get_node_ip_address(), [str(i) for i in ray.get_gpu_ids()]


def slot_gpus(
    placement: PlacedGroups, role: str, world: int, timeout_s: float = 60.0
) -> list[tuple[str, list[str]]]:
    """(node IP, GPU ids) of each of `role`'s `world` slots, from a task in each slot holding what
    the rank's actor will hold (before the actors take it): which GPU a bundle got is Ray's choice."""
    import ray

    probe = ray.remote(_node_and_gpus)
    refs = [probe.options(**placement.options(role, rank)).remote() for rank in range(world)]
    return [(str(ip), list(ids)) for ip, ids in ray.get(refs, timeout=timeout_s)]


def shared_gpu(gpus: Sequence[tuple[str, Sequence[str]]]) -> tuple[int, int, str, str] | None:
    """(first rank, second rank, GPU id, node IP) of two ranks given one GPU, or None."""
    holder: dict[tuple[str, str], int] = {}
    for rank, (ip, ids) in enumerate(gpus):
        for gpu in ids:
            if (ip, gpu) in holder:
                return holder[(ip, gpu)], rank, gpu, ip
            holder[(ip, gpu)] = rank
    return None


def fractional_gpu_bundles(placement: PlacedGroups, role: str, world: int) -> bool:
    """Whether any of `role`'s ranks sits on a bundle of less than one GPU (and more than none):
    only then can Ray give two of its bundles one GPU (`gpu_sharing`: fewer GPUs than bundles)."""
    plan = placement.plan
    for rank in range(world):
        slot = plan.slot(role, rank)
        if 0 < plan.groups[slot.group].bundles[slot.bundle].get("GPU", 0.0) < 1:
            return True
    return False


def check_ranks_on_distinct_gpus(
    placement: PlacedGroups, role: str, world: int, who: str, fewer: str
) -> None:
    """Refuse (`PlacementError`, one line) a placement that gives two ranks of one NCCL group
    (the ranks of a worker group, an engine's tensor-parallel workers) one GPU: NCCL 2.29.7, the
    one torch 2.13.0 pins, refuses them ("Duplicate GPU detected") at the group's first
    collective. Only bundles of a fraction of a GPU can do this; `fewer` names the key to lower."""
    if world < 2 or not fractional_gpu_bundles(placement, role, world):
        return
    found = shared_gpu(slot_gpus(placement, role, world))
    if found is None:
        return
    first, second, gpu, ip = found
    raise PlacementError(
        f"{who} ranks {first} and {second} would share GPU {gpu} on {ip}: this machine has fewer GPUs than "
        "the placement's GPU bundles, so each bundle got a share of one, and NCCL refuses two ranks of one "
        "process group on one GPU. Set trainer.placement.colocate_all=true (each GPU then holds one rank of "
        f"every model and one engine, which sleep while the policy trains), or lower {fewer}"
    )
