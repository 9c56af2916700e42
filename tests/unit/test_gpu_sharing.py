"""A local Ray with fewer GPUs than GPU bundles is seen at start, over fake cluster views
(`placement.cluster_nodes()`'s shape): one line with what was asked and what the node has."""

from __future__ import annotations

import pytest

from skylift.cluster.gpu_sharing import gpu_share
from skylift.cluster.placement import PlacementRequest, plan_placement


def node(ip: str, gpus: float, cpus: float = 16) -> dict:
    return {"ip": ip, "id": f"id-{ip}", "resources": {"CPU": cpus, "GPU": gpus, "memory": 1e9}}


def test_fewer_gpus_than_bundles_on_a_local_ray_share_them_and_say_so() -> None:
    # a one-GPU policy and two one-GPU engines: three GPU bundles on a two-GPU machine
    plan = plan_placement(PlacementRequest(num_engines=2, gpu=True))
    needed = plan.total()["GPU"]
    assert needed == 3
    shared = gpu_share(needed, [node("10.0.0.5", 2)], joined=False)
    # Ray takes a bundle's share from one GPU: half a GPU each (2 x 2 places), not 2/3 (placed on
    # 2 GPUs only: the third bundle never becomes ready)
    assert shared is not None and shared.share == 0.5
    assert shared.line.startswith(
        "fewer GPUs than GPU bundles: the placement asks for 3 GPU bundle(s), and 10.0.0.5 has 2 GPU(s); "
        "the bundles share the GPUs (0.50 GPU each)"
    )
    assert gpu_share(9, [node("10.0.0.5", 8)], joined=False).share == 0.5  # type: ignore[union-attr]
    assert gpu_share(17, [node("10.0.0.5", 8)], joined=False).share == pytest.approx(1 / 3)  # type: ignore[union-attr]
    assert "CUDA IPC" in shared.line and "NCCL refuses" in shared.line


def test_enough_gpus_no_gpu_or_a_joined_cluster_are_left_alone() -> None:
    assert gpu_share(3, [node("10.0.0.5", 4)], joined=False) is None
    assert gpu_share(3, [node("10.0.0.5", 3)], joined=False) is None
    assert gpu_share(3, [node("10.0.0.5", 0)], joined=False) is None  # no GPU: placement says so
    assert gpu_share(0, [node("10.0.0.5", 1)], joined=False) is None  # a CPU run
    # a joined cluster short of GPUs is not shrunk: its placement fails with both sides
    assert gpu_share(3, [node("10.0.0.5", 1), node("10.0.0.6", 1)], joined=True) is None


def test_every_gpu_node_of_a_local_view_is_named() -> None:
    shared = gpu_share(4, [node("10.0.0.5", 1), node("10.0.0.6", 0), node("10.0.0.7", 1)], joined=False)
    assert shared is not None and shared.share == 0.5
    assert "10.0.0.5 has 1 GPU(s), 10.0.0.7 has 1 GPU(s)" in shared.line and "10.0.0.6" not in shared.line


def test_two_ranks_given_one_gpu_are_found() -> None:
    """`shared_gpu` over what Ray gave each rank's slot: (first, second, GPU, node) or None."""
    from skylift.cluster.ray_ranks import shared_gpu

    assert shared_gpu([("10.0.0.1", ["0"]), ("10.0.0.1", ["1"])]) is None
    assert shared_gpu([("10.0.0.1", ["0"]), ("10.0.0.2", ["0"])]) is None  # GPU 0 of two nodes
    assert shared_gpu([("10.0.0.1", []), ("10.0.0.1", [])]) is None  # CPU ranks
    assert shared_gpu([("10.0.0.1", ["0"]), ("10.0.0.1", ["1"]), ("10.0.0.1", ["1"])]) == (
        1,
        2,
        "1",
        "10.0.0.1",
    )


def test_a_driver_without_cuda_joining_a_gpu_cluster_is_refused() -> None:
    from skylift.cluster.gpu_sharing import driver_without_gpus

    gpu_nodes = [{"ip": "10.0.0.1", "resources": {"CPU": 8}}, {"ip": "10.0.0.2", "resources": {"GPU": 8}}]
    line = driver_without_gpus("10.0.0.1:6379", False, gpu_nodes)
    assert line is not None and line.startswith(
        "the Ray cluster at 10.0.0.1:6379 has 8 GPU(s), and this machine"
    )
    assert "--entrypoint-num-gpus 1" in line
    assert driver_without_gpus("10.0.0.1:6379", True, gpu_nodes) is None  # a driver on a GPU node
    assert driver_without_gpus(None, False, gpu_nodes) is None  # a local Ray: its own devices
    assert driver_without_gpus("10.0.0.1:6379", False, [{"ip": "10.0.0.1", "resources": {"CPU": 8}}]) is None
