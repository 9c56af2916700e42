"""Where a run's actors go: Ray placement groups built from the `trainer.placement.*` keys.

`plan_placement` is pure: it turns the keys into placement groups (bundles and a strategy) and
says which bundle each policy / reference / critic rank and each local engine rank uses. On GPU
nodes a bundle holds one GPU (plus `num_cpus_per_worker` CPUs); on CPU-only clusters it holds
`num_cpus_per_worker` CPUs, so `*_num_gpus_per_node` counts worker processes there.

- `colocate_all`: one group of `num_inference_engines * tensor_parallel_size` bundles shared by
  the engines and every training model (each actor takes an equal share of its bundle);
- `colocate_policy_ref`: policy and reference ranks share the policy's bundles (same sizes);
- otherwise each model has its own group: on one node (`num_nodes=1`) one bundle per rank,
  PACK; on several, one bundle of `num_gpus_per_node` units per node, STRICT_SPREAD (each on a
  different node); each engine has its own group (STRICT_PACK: one bundle per tensor-parallel
  rank, all on one node).

`check_feasible` compares a plan with the cluster's nodes before anything waits, and
`PlacedGroups` (the Ray part) creates the groups, fails within a timeout with what was asked and
what the cluster has, and gives each actor its scheduling options.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skylift.config.schema import SkyliftConfig

#: Roles whose ranks are training workers.
TRAINING_ROLES = ("policy", "ref", "critic")


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested placement (says what was asked and what it has)."""


@dataclass(frozen=True)
class PlacementRequest:
    """The placement keys of a run, as plain numbers (see `request_from_config`)."""

    policy_nodes: int = 1
    policy_per_node: int = 1
    ref_nodes: int = 1
    ref_per_node: int = 1
    critic_nodes: int = 1
    critic_per_node: int = 1
    with_policy: bool = True  # False: an eval-only run (engines only)
    with_ref: bool = False
    with_critic: bool = False
    num_engines: int = 0  # local engines (0 with remote engines)
    engine_tp: int = 1
    colocate_all: bool = False
    colocate_policy_ref: bool = True
    gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_bundle: float = 1.0  # below 1 when one machine has fewer GPUs than bundles (shared)

    def world(self, role: str) -> int:
        return int(getattr(self, f"{role}_nodes")) * int(getattr(self, f"{role}_per_node"))

    def roles(self) -> list[str]:
        return (
            (["policy"] if self.with_policy else [])
            + (["ref"] if self.with_ref else [])
            + (["critic"] if self.with_critic else [])
        )


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: its bundles, Ray strategy and the (role, rank) actors on each bundle."""

    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: str
    members: tuple[tuple[tuple[str, int], ...], ...]  # per bundle: (role, rank) of its actors


@dataclass(frozen=True)
class ActorSlot:
    """Where one actor goes: group index, bundle index and the resources it takes from it."""

    group: int
    bundle: int
    resources: dict[str, float]


@dataclass(frozen=True)
class PlacementPlan:
    groups: tuple[GroupPlan, ...]
    slots: dict[tuple[str, int], ActorSlot] = field(default_factory=dict)

    def slot(self, role: str, rank: int = 0) -> ActorSlot:
        try:
            return self.slots[(role, rank)]
        except KeyError:
            raise PlacementError(f"the placement plan has no slot for {role} rank {rank}") from None

    def total(self) -> dict[str, float]:
        """Resources of every bundle together."""
        out: dict[str, float] = {}
        for group in self.groups:
            for bundle in group.bundles:
                for key, value in bundle.items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def describe(self) -> str:
        """`policy: 2 x {CPU: 1} PACK; engine-0: 1 x {CPU: 1} STRICT_PACK`."""
        parts = []
        for g in self.groups:
            shapes: dict[str, int] = {}
            for b in g.bundles:
                key = _fmt(b)
                shapes[key] = shapes.get(key, 0) + 1
            parts.append(
                f"{g.name}: " + " + ".join(f"{n} x {k}" for k, n in shapes.items()) + f" {g.strategy}"
            )
        return "; ".join(parts)


def engine_role(index: int) -> str:
    """The role name of local engine `index` (its ranks are the tensor-parallel ranks)."""
    return f"engine-{index}"


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _bundle(req: PlacementRequest) -> dict[str, float]:
    if req.gpu:
        return {"GPU": req.gpus_per_bundle, "CPU": req.cpus_per_worker}
    return {"CPU": req.cpus_per_worker}


def plan_placement(req: PlacementRequest) -> PlacementPlan:
    """The placement groups and actor slots of `req` (raises `PlacementError` on contradictions)."""
    if req.cpus_per_worker <= 0:
        raise PlacementError(f"trainer.placement.num_cpus_per_worker must be > 0, got {req.cpus_per_worker}")
    roles = req.roles()
    # per group: name, strategy, bundles; a bundle is a list of positions (one unit of resources
    # each), a position the (role, rank) actors sharing its unit
    groups: list[tuple[str, str, list[list[list[tuple[str, int]]]]]] = []
    engine_ranks = [(engine_role(e), r) for e in range(req.num_engines) for r in range(req.engine_tp)]
    if req.colocate_all:
        size = len(engine_ranks)
        if size == 0:
            raise PlacementError("trainer.placement.colocate_all=true needs local inference engines")
        for role in roles:
            if req.world(role) != size:
                raise PlacementError(
                    f"trainer.placement.colocate_all=true puts every model on the engines' {size} bundle(s) "
                    f"(generator.num_inference_engines x inference_engine_tensor_parallel_size), but {role} "
                    f"has {req.world(role)} worker(s) ({role}_num_nodes x {role}_num_gpus_per_node)"
                )
        shared = [[[(role, rank) for role in roles] + [engine_ranks[rank]]] for rank in range(size)]
        groups.append(("colocate_all", "PACK", shared))
    else:
        shared_ref = req.with_ref and req.colocate_policy_ref
        if shared_ref and (req.ref_nodes, req.ref_per_node) != (req.policy_nodes, req.policy_per_node):
            raise PlacementError(
                "trainer.placement.colocate_policy_ref=true puts reference ranks on the policy's bundles: "
                f"ref_num_nodes x ref_num_gpus_per_node ({req.ref_nodes} x {req.ref_per_node}) must equal "
                f"policy_num_nodes x policy_num_gpus_per_node ({req.policy_nodes} x {req.policy_per_node})"
            )
        for role in roles:
            if role == "ref" and shared_ref:
                continue
            sharing = [role, "ref"] if role == "policy" and shared_ref else [role]
            nodes, per_node = int(getattr(req, f"{role}_nodes")), int(getattr(req, f"{role}_per_node"))
            positions = [[(r, rank) for r in sharing] for rank in range(nodes * per_node)]
            name = "+".join(sharing)
            if nodes == 1:  # one bundle per rank, packed
                groups.append((name, "PACK", [[p] for p in positions]))
            else:  # one bundle per node, each on a different node: num_nodes is honoured exactly
                per = [positions[n * per_node : (n + 1) * per_node] for n in range(nodes)]
                groups.append((name, "STRICT_SPREAD", per))
        for e in range(req.num_engines):
            role = engine_role(e)
            groups.append((role, "STRICT_PACK", [[[(role, r)]] for r in range(req.engine_tp)]))
    unit = _bundle(req)
    plans: list[GroupPlan] = []
    slots: dict[tuple[str, int], ActorSlot] = {}
    for gi, (name, strategy, bundles) in enumerate(groups):
        plans.append(
            GroupPlan(
                name=name,
                bundles=tuple({k: v * len(b) for k, v in unit.items()} for b in bundles),
                strategy=strategy,
                members=tuple(tuple(m for position in b for m in position) for b in bundles),
            )
        )
        for bi, bundle in enumerate(bundles):
            for position in bundle:
                for key in position:
                    slots[key] = ActorSlot(gi, bi, {k: v / len(position) for k, v in unit.items()})
    return PlacementPlan(groups=tuple(plans), slots=slots)


def check_feasible(plan: PlacementPlan, nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """Why `nodes` (each node's total resources) cannot hold `plan`; empty when they might.

    Checks every bundle fits on some node, a STRICT_PACK group fits on one node, and the whole
    plan fits in the cluster's totals (a PACK group may spread over nodes).
    """
    problems: list[str] = []
    total: dict[str, float] = {}
    for node in nodes:
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value

    def fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
        return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)

    for group in plan.groups:
        for bundle in group.bundles:
            if not any(fits(bundle, node) for node in nodes):
                problems.append(f"{group.name}: no node has a bundle's {_fmt(bundle)}")
                break
        if group.strategy == "STRICT_SPREAD":
            hosts = sum(1 for node in nodes if all(fits(b, node) for b in group.bundles[:1]))
            if hosts < len(group.bundles):
                problems.append(
                    f"{group.name}: {len(group.bundles)} bundles of {_fmt(group.bundles[0])} must be on "
                    f"{len(group.bundles)} different nodes, and {hosts} node(s) can hold one"
                )
        if group.strategy == "STRICT_PACK":
            need: dict[str, float] = {}
            for bundle in group.bundles:
                for key, value in bundle.items():
                    need[key] = need.get(key, 0.0) + value
            if not any(fits(need, node) for node in nodes):
                problems.append(f"{group.name}: its ranks must share one node, and no node has {_fmt(need)}")
    if not fits(plan.total(), total):
        problems.append(f"all groups together need {_fmt(plan.total())}, the cluster has {_fmt(total)}")
    return problems


def request_from_config(cfg: SkyliftConfig, gpu: bool) -> PlacementRequest:
    """The `PlacementRequest` of a `SkyliftConfig` (`gpu`: whether the cluster's workers use GPUs)."""
    t, g = cfg.trainer, cfg.generator
    p = t.placement
    return PlacementRequest(
        policy_nodes=p.policy_num_nodes,
        policy_per_node=p.policy_num_gpus_per_node,
        ref_nodes=p.ref_num_nodes,
        ref_per_node=p.ref_num_gpus_per_node,
        critic_nodes=p.critic_num_nodes,
        critic_per_node=p.critic_num_gpus_per_node,
        with_ref=bool(t.algorithm.use_kl_loss or t.algorithm.use_kl_in_reward),
        with_critic=t.algorithm.advantage_estimator == "gae",
        num_engines=g.num_inference_engines if g.run_engines_locally else 0,
        engine_tp=g.inference_engine_tensor_parallel_size,
        colocate_all=p.colocate_all,
        colocate_policy_ref=p.colocate_policy_ref,
        gpu=gpu,
        cpus_per_worker=p.num_cpus_per_worker,
    )


def uses_ray(cfg: SkyliftConfig, eval_only: bool = False) -> bool:
    """Whether a run places its parts with Ray: `trainer.placement.backend=ray`, or ``auto`` with
    local engines or more than one policy worker (an eval-only run: only with local engines)."""
    t, g = cfg.trainer, cfg.generator
    world = 0 if eval_only else t.policy_world_size()
    backend = t.placement.backend
    use = backend == "ray" or (backend == "auto" and (g.run_engines_locally or world > 1))
    if eval_only and not g.run_engines_locally:
        return False  # nothing to place: the remote engines are the whole run
    return use


# ------------------------------------------------------------------------------------ Ray part


def cluster_nodes() -> list[dict[str, Any]]:
    """Alive nodes of the connected cluster: `{"ip", "id", "resources"}` (logical resources)."""
    import ray

    return [
        {
            "ip": n["NodeManagerAddress"],
            "id": n["NodeID"],
            "resources": {k: float(v) for k, v in n["Resources"].items() if "_group_" not in k},
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]


def describe_cluster(nodes: Sequence[Mapping[str, Any]]) -> str:
    """`2 node(s): 10.0.0.1 {CPU: 2, GPU: 4}, ...` (standard resources only)."""
    shown = ("CPU", "GPU")
    return f"{len(nodes)} node(s): " + ", ".join(
        f"{n['ip']} {_fmt({k: v for k, v in n['resources'].items() if k in shown})}" for n in nodes
    )


def infeasible_message(plan: PlacementPlan, nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the cluster's `nodes` (`cluster_nodes()`: "ip", "resources") cannot hold `plan`, in the
    line a run stops with; None when they might."""
    problems = check_feasible(plan, [n["resources"] for n in nodes])
    if not problems:
        return None
    return (
        f"the cluster cannot hold the requested placement ({plan.describe()}): "
        + "; ".join(problems)
        + f". The cluster has {describe_cluster(nodes)}"
    )


class PlacedGroups:
    """The plan's Ray placement groups, created and ready; `options(role, rank)` for each actor."""

    def __init__(self, plan: PlacementPlan, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.plan = plan
        nodes = cluster_nodes()
        refusal = infeasible_message(plan, nodes)
        if refusal is not None:
            raise PlacementError(refusal)
        self.groups = [
            placement_group([dict(b) for b in g.bundles], strategy=g.strategy, name="") for g in plan.groups
        ]
        started = time.monotonic()
        ready = [pg.ready() for pg in self.groups]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if pending:
            late = [plan.groups[i].name for i, ref in enumerate(ready) if ref in pending]
            for pg in self.groups:
                remove_placement_group(pg)
            available = ray.available_resources()
            raise PlacementError(
                f"placement group(s) {late} not ready within {timeout_s:.0f} s "
                f"(trainer.placement.timeout_s): asked for {plan.describe()}; the cluster has "
                f"{describe_cluster(nodes)}, of which {_fmt({k: v for k, v in available.items() if k in ('CPU', 'GPU')})} "
                "is free now"
            )
        self.wait_s = time.monotonic() - started
        table = ray.util.placement_group_table()
        ip_of = {n["id"]: n["ip"] for n in cluster_nodes()}
        self.bundle_ips: list[list[str]] = []
        for pg in self.groups:
            entry = table.get(pg.id.hex(), {})
            to_node = entry.get("bundles_to_node_id", {})
            self.bundle_ips.append([ip_of.get(to_node.get(i, ""), "?") for i in range(pg.bundle_count)])

    def options(self, role: str, rank: int = 0, capture_child_tasks: bool = False) -> dict[str, Any]:
        """`actor_cls.options(**...)` placing (role, rank) on its bundle with its share."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.plan.slot(role, rank)
        res = dict(slot.resources)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0),
            "num_gpus": res.pop("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[slot.group],
                placement_group_bundle_index=slot.bundle,
                placement_group_capture_child_tasks=capture_child_tasks,
            ),
        }
        if res:
            options["resources"] = res
        return options

    def node_ip(self, role: str, rank: int = 0) -> str:
        """The IP of the node holding (role, rank)'s bundle."""
        slot = self.plan.slot(role, rank)
        return self.bundle_ips[slot.group][slot.bundle]

    def layout(self) -> str:
        """`policy -> 10.0.0.1; engine-0 -> 10.0.0.2` (the node of each group's bundles)."""
        return "; ".join(
            f"{g.name} -> {', '.join(sorted(set(ips)))}"
            for g, ips in zip(self.plan.groups, self.bundle_ips, strict=True)
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # the cluster may already be gone at shutdown
                pass
        self.groups = []
