"""Ranks of one NCCL group on one GPU, refused before NCCL sees them (issue 50, item 1's rule for
the training groups and vLLM's tensor-parallel workers).

A local Ray on a machine with fewer GPUs than the run's GPU bundles gives each bundle a share of a
GPU (`cluster.gpu_sharing`), and which GPU a bundle gets is Ray's choice: it packs the bundles of a
group onto the first GPU with room, so a policy of two ranks gets both on GPU 0, which NCCL 2.29.7
refuses ("Duplicate GPU detected") at the group's first collective. Here Ray runs with two logical
GPUs of its own (`num_gpus=2`: Ray assigns GPU ids and CUDA_VISIBLE_DEVICES to tasks and actors as
on a GPU machine; nothing touches CUDA), the plan is the run's (`request_from_config(gpu=True)`,
`shared_placement`), and the real `WorkerGroup` and `start_local_engines` refuse in one line before
any rank or engine starts.

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/integration/test_gpu_sharing_ranks.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_helpers import require_loopback_namespace

from skylift.cluster.engines import start_local_engines
from skylift.cluster.gpu_sharing import shared_placement
from skylift.cluster.placement import PlacedGroups, PlacementError, cluster_nodes, request_from_config
from skylift.cluster.ray_ranks import slot_gpus
from skylift.cluster.worker_group import WorkerGroup
from skylift.config import load_config
from skylift.worker.training_worker import WorkerSettings

LOGICAL_GPUS = 2


@pytest.fixture(scope="module")
def ray_with_gpus() -> Iterator[None]:
    require_loopback_namespace()
    import ray

    if ray.is_initialized():  # another module's Ray, without GPUs
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=LOGICAL_GPUS,
        include_dashboard=False,
        object_store_memory=256 << 20,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()


def _placed(overrides: list[str]) -> PlacedGroups:
    """The run's placement on this Ray: GPU bundles, shared as `start_ray_run` shares them."""
    cfg = load_config(overrides)
    plan, shared = shared_placement(request_from_config(cfg, gpu=True), cluster_nodes(), joined=False)
    assert shared is not None and shared.share == 0.5  # 4 GPU bundles on 2 GPUs
    return PlacedGroups(plan, timeout_s=60)


def test_two_policy_ranks_on_one_gpu_are_refused_naming_both_and_the_fix(ray_with_gpus: None) -> None:
    placed = _placed(
        [
            "trainer.placement.policy_num_gpus_per_node=2",
            "trainer.placement.ref_num_gpus_per_node=2",
            "trainer.algorithm.use_kl_loss=true",
            "generator.num_inference_engines=2",
        ]
    )
    try:
        # what Ray gives the policy's two bundles: one GPU for both
        assert slot_gpus(placed, "policy", 2) == [("127.0.0.1", ["0"]), ("127.0.0.1", ["0"])]
        with pytest.raises(PlacementError) as caught:
            WorkerGroup(
                "policy", WorkerSettings(model_path="no-model-is-loaded"), world_size=2, placement=placed
            )
        message = str(caught.value)
        assert message.startswith("policy ranks 0 and 1 would share GPU 0 on 127.0.0.1: ")
        assert "NCCL refuses two ranks of one process group on one GPU" in message
        assert "trainer.placement.colocate_all=true" in message
        assert message.endswith("or lower trainer.placement.policy_num_gpus_per_node")
        # one rank alone has no peer to collide with: its group is made
        single = WorkerGroup(
            "ref", WorkerSettings(model_path="no-model-is-loaded"), world_size=1, placement=placed
        )
        single.shutdown()
    finally:
        placed.remove()


def test_an_engines_tensor_parallel_workers_on_one_gpu_are_refused_before_vllm_starts(
    ray_with_gpus: None,
) -> None:
    placed = _placed(
        [
            "trainer.placement.policy_num_gpus_per_node=2",
            "generator.inference_engine_tensor_parallel_size=2",
        ]
    )
    try:
        with pytest.raises(
            PlacementError, match=r"^engine-0's tensor-parallel ranks 0 and 1 would share GPU"
        ):
            start_local_engines(
                1,
                "no-model-is-loaded",
                {"tensor_parallel_size": 2},
                startup_timeout_s=5,
                call_timeout_s=5,
                placement=placed,
            )
    finally:
        placed.remove()


def test_a_run_started_without_cuda_on_a_gpu_cluster_stops_naming_the_fix(ray_with_gpus: None) -> None:
    """Joining a cluster with GPUs from a machine without CUDA (a CPU-only head node) would plan
    CPU bundles and train on CPU beside the GPUs: `start_ray_run` refuses it in one line."""
    import ray

    from skylift.cluster.ray_start import start_ray_run

    address = ray.get_runtime_context().gcs_address
    cfg = load_config([f"trainer.ray_address={address}"])
    with pytest.raises(PlacementError) as caught:
        start_ray_run(cfg)
    assert str(caught.value).startswith(f"the Ray cluster at {address} has 2 GPU(s), and this machine")
    assert ray.is_initialized()  # the run joined a cluster it did not start: it leaves it running
