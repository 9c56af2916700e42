"""FSDP2 policy ranks on two nodes of a running Ray cluster (RAY_ADDRESS), checked against one rank.

`python run_fsdp.py OUT.json MODEL_DIR`: places a 2-rank policy by `policy_num_nodes=2` (one rank
per node), runs its setup (the ranks meet at rank 0's node IP over TCP) and one sharded logprob
pass (FSDP2 gathers the parameters across the hosts), and compares the logprobs with a single
in-process rank. OUT.json: `node_ips`, `init_method`, `max_abs_diff`, `error`.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(out: str, model_dir: str) -> int:
    import ray
    import torch

    from skylift.cluster.placement import PlacedGroups, PlacementRequest, plan_placement
    from skylift.cluster.ray_start import init_ray
    from skylift.cluster.worker_group import RLWorker, WorkerGroup
    from skylift.worker.batch import build_sequence_batch
    from skylift.worker.training_worker import WorkerSettings

    report: dict = {"error": None}
    init_ray()
    placed = None
    group = None
    try:
        plan = plan_placement(PlacementRequest(policy_nodes=2, policy_per_node=1, cpus_per_worker=1))
        placed = PlacedGroups(plan, timeout_s=60)
        settings = WorkerSettings(model_path=model_dir, seed=0, collective_timeout_s=60)
        group = WorkerGroup("policy", settings, 2, use_ray=True, placement=placed, timeout_s=120)
        report["node_ips"] = group.node_ips
        group.setup()
        report["init_method"] = ray.get(group.workers[0].__ray_call__.remote(lambda w: w.init_method))
        batch = build_sequence_batch(
            [[1, 5, 9, 3], [2, 4, 6, 8], [7, 7, 1, 2], [3, 1, 4, 1]],
            [[11, 12, 13], [14, 15], [16, 17, 18], [19]],
        )
        sharded = group.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
        single = RLWorker(settings, 0, 1)
        single.setup()
        reference = single.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
        report["max_abs_diff"] = float((sharded - reference).abs().max())
        assert torch.isfinite(sharded).all()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if group is not None:
            group.shutdown()
        if placed is not None:
            placed.remove()
        ray.shutdown()
        with open(out, "w") as f:
            json.dump(report, f)
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
