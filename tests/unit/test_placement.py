"""Bundle layouts from SkyRL's placement keys (pure functions of skylift.cluster.placement)."""

from __future__ import annotations

import pytest

from skylift.cluster.placement import (
    PlacementError,
    PlacementRequest,
    check_feasible,
    plan_placement,
    request_from_config,
)
from skylift.config import load_config
from skylift.utils.network import interface_of, is_loopback, route_address, url_host
from skylift.weight_sync.broadcast.sender import weight_sync_master_address


def test_separate_groups_for_policy_and_each_engine() -> None:
    plan = plan_placement(PlacementRequest(policy_per_node=2, num_engines=2, engine_tp=1))
    assert [(g.name, len(g.bundles), g.strategy) for g in plan.groups] == [
        ("policy", 2, "PACK"),
        ("engine-0", 1, "STRICT_PACK"),
        ("engine-1", 1, "STRICT_PACK"),
    ]
    assert plan.groups[0].bundles == ({"CPU": 1.0}, {"CPU": 1.0})
    assert plan.slot("policy", 1).bundle == 1
    assert plan.slot("engine-1", 0).group == 2
    assert plan.total() == {"CPU": 4.0}


def test_seed_layout_4_plus_4_gpus_on_two_nodes() -> None:
    """The seed's layout: 4 GPUs of policy + reference (colocated), 4 engines of TP 1."""
    req = PlacementRequest(
        policy_per_node=4, ref_per_node=4, with_ref=True, num_engines=4, engine_tp=1, gpu=True
    )
    plan = plan_placement(req)
    assert plan.groups[0].name == "policy+ref"
    assert plan.groups[0].members[3] == (("policy", 3), ("ref", 3))
    # policy and reference share each bundle's GPU half and half
    assert plan.slot("ref", 2).resources == {"GPU": 0.5, "CPU": 0.5}
    assert plan.total() == {"GPU": 8.0, "CPU": 8.0}
    two_nodes = [{"GPU": 4.0, "CPU": 32.0}, {"GPU": 4.0, "CPU": 32.0}]
    assert check_feasible(plan, two_nodes) == []
    assert check_feasible(plan, two_nodes[:1]) == [
        "all groups together need {CPU: 8, GPU: 8}, the cluster has {CPU: 32, GPU: 4}"
    ]


def test_tensor_parallel_engine_ranks_must_share_a_node() -> None:
    plan = plan_placement(PlacementRequest(num_engines=1, engine_tp=4, gpu=True))
    engine = plan.groups[1]
    assert (engine.name, engine.strategy, len(engine.bundles)) == ("engine-0", "STRICT_PACK", 4)
    problems = check_feasible(plan, [{"GPU": 2.0, "CPU": 8.0}, {"GPU": 3.0, "CPU": 8.0}])
    assert problems == ["engine-0: its ranks must share one node, and no node has {CPU: 4, GPU: 4}"]


def test_colocate_all_shares_the_engines_bundles() -> None:
    req = PlacementRequest(
        policy_per_node=2, ref_per_node=2, with_ref=True, num_engines=2, colocate_all=True, gpu=True
    )
    plan = plan_placement(req)
    assert [(g.name, len(g.bundles)) for g in plan.groups] == [("colocate_all", 2)]
    assert plan.groups[0].members[1] == (("policy", 1), ("ref", 1), ("engine-1", 0))
    assert plan.slot("engine-0").resources["GPU"] == pytest.approx(1 / 3)


def test_colocate_all_with_mismatched_sizes_names_both() -> None:
    with pytest.raises(PlacementError, match=r"engines' 2 bundle.*policy has 4 worker"):
        plan_placement(PlacementRequest(policy_per_node=4, num_engines=2, colocate_all=True))


def test_colocate_policy_ref_needs_equal_sizes() -> None:
    with pytest.raises(PlacementError, match=r"ref_num_nodes x ref_num_gpus_per_node \(1 x 1\)"):
        plan_placement(PlacementRequest(policy_per_node=2, with_ref=True))
    plan = plan_placement(PlacementRequest(policy_per_node=2, with_ref=True, colocate_policy_ref=False))
    assert [g.name for g in plan.groups] == ["policy", "ref"]


def test_cpu_bundles_sized_by_num_cpus_per_worker() -> None:
    plan = plan_placement(PlacementRequest(num_engines=1, cpus_per_worker=2))
    assert [g.bundles for g in plan.groups] == [({"CPU": 2.0},), ({"CPU": 2.0},)]
    # two 2-CPU nodes: policy and engine cannot share one, so they land on different nodes
    assert check_feasible(plan, [{"CPU": 2.0}, {"CPU": 2.0}]) == []
    assert check_feasible(plan, [{"CPU": 3.0}]) == [
        "all groups together need {CPU: 4}, the cluster has {CPU: 3}"
    ]
    with pytest.raises(PlacementError, match="num_cpus_per_worker must be > 0"):
        plan_placement(PlacementRequest(cpus_per_worker=0))


def test_bundle_too_big_for_any_node() -> None:
    plan = plan_placement(PlacementRequest(gpu=True))
    assert check_feasible(plan, [{"CPU": 16.0}]) == [
        "policy: no node has a bundle's {CPU: 1, GPU: 1}",
        "all groups together need {CPU: 1, GPU: 1}, the cluster has {CPU: 16}",
    ]


def test_request_from_config_reads_skyrl_keys() -> None:
    cfg = load_config(
        overrides=[
            "trainer.placement.policy_num_nodes=2",
            "trainer.placement.policy_num_gpus_per_node=4",
            "trainer.placement.ref_num_nodes=2",
            "trainer.placement.ref_num_gpus_per_node=4",
            "trainer.placement.num_cpus_per_worker=3",
            "trainer.algorithm.use_kl_loss=true",
            "generator.num_inference_engines=2",
            "generator.inference_engine_tensor_parallel_size=2",
        ]
    )
    req = request_from_config(cfg, gpu=True)
    assert (req.world("policy"), req.world("ref"), req.with_ref, req.with_critic) == (8, 8, True, False)
    assert (req.num_engines, req.engine_tp, req.cpus_per_worker) == (2, 2, 3.0)
    remote = load_config(overrides=["generator.run_engines_locally=false"])
    assert request_from_config(remote, gpu=False).num_engines == 0


def test_weight_sync_master_address() -> None:
    assert weight_sync_master_address("10.0.0.9", ["127.0.0.1:8001"], "10.0.0.1") == "10.0.0.9"
    assert weight_sync_master_address(None, [], "10.0.0.1") == "10.0.0.1"  # local engines: node IP
    assert weight_sync_master_address(None, ["http://127.0.0.1:8001"], "10.0.0.1") == "127.0.0.1"


def test_network_helpers() -> None:
    assert url_host("http://10.1.2.3:8001/v1") == "10.1.2.3"
    assert url_host("myhost:8001") == "myhost"
    assert is_loopback("127.0.0.5") and is_loopback("localhost") and not is_loopback("10.0.0.1")
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here


def test_example_two_node_config_needs_both_nodes() -> None:
    """examples/several_machines/two_nodes_4plus4.yaml: 4 GPUs of policy+ref, one TP-4 engine."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "several_machines" / "two_nodes_4plus4.yaml"
    cfg = load_config(
        ["trainer.algorithm.use_kl_loss=true", "data.train_data=['x.parquet']"], config_file=path
    )
    plan = plan_placement(request_from_config(cfg, gpu=True))
    assert [(g.name, len(g.bundles), g.strategy) for g in plan.groups] == [
        ("policy+ref", 4, "PACK"),
        ("engine-0", 4, "STRICT_PACK"),
    ]
    node = {"GPU": 4.0, "CPU": 32.0}
    assert check_feasible(plan, [node, node]) == []
    assert check_feasible(plan, [node]) == [
        "all groups together need {CPU: 32, GPU: 8}, the cluster has {CPU: 32, GPU: 4}"
    ]


def test_several_policy_nodes_spread_one_bundle_per_node() -> None:
    plan = plan_placement(
        PlacementRequest(
            policy_nodes=2, policy_per_node=4, ref_nodes=2, ref_per_node=4, with_ref=True, gpu=True
        )
    )
    group = plan.groups[0]
    assert (group.name, group.strategy) == ("policy+ref", "STRICT_SPREAD")
    assert group.bundles == ({"GPU": 4.0, "CPU": 4.0}, {"GPU": 4.0, "CPU": 4.0})
    assert plan.slot("policy", 5).bundle == 1 and plan.slot("ref", 3).bundle == 0
    assert plan.slot("ref", 5).resources == {"GPU": 0.5, "CPU": 0.5}
    node = {"GPU": 4.0, "CPU": 16.0}
    assert check_feasible(plan, [node, node]) == []
    assert check_feasible(plan, [{"GPU": 8.0, "CPU": 32.0}]) == [
        "policy+ref: 2 bundles of {CPU: 4, GPU: 4} must be on 2 different nodes, and 1 node(s) can hold one"
    ]
