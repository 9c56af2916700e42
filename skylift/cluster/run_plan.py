"""What a `skylift train` run would do on GPUs this machine does not have: `skylift train --dry-run
--gpus N [--gpu-memory-gib G] [--nodes M]` plans it for M node(s) of N GPUs of G GiB and starts
nothing.

The plan applies the run's own rules to the stated cluster, so a change to a rule changes the
plan: the GPU defaults (`config.loading.load_config_for(..., cuda=True)`), whether the run uses
Ray (`placement.uses_ray`), the placement groups and whether the cluster holds them
(`placement.plan_placement`, `infeasible_message`), GPU sharing on one machine short of GPUs
(`gpu_sharing.shared_placement`), colocation and its memory split (`colocation.colocation_plan`,
`colocated_engine_fraction`), the weight-sync transport (`weight_sync.factory.check_backend` /
`transport_kind`, `weight_sync.placed.resolve` on the places the plan gives the ranks) and the
tensor-parallel engines' Ray executor environment (`engines.ray_executor_env`). Where the run
decides from what it sees at run time (remote engines' places, which GPU Ray gives a shared
bundle), the plan says so instead of guessing.

A planned place is a host and a GPU named by its bundle: two ranks share a GPU exactly when they
share a one-GPU bundle (`colocate_all`), or run in one process (placement backend ``local``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skylift.cluster.colocation import (
    GIB,
    ColocationError,
    awake_engine_fraction,
    colocated_engine_fraction,
    colocation_plan,
)
from skylift.cluster.gpu_sharing import GpuShare, shared_placement
from skylift.cluster.placement import (
    PlacementError,
    PlacementPlan,
    engine_role,
    infeasible_message,
    plan_placement,
    request_from_config,
    uses_ray,
)
from skylift.config.schema import SkyliftConfig
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.topology import Place, choose_transports

#: the GPU memory `--gpu-memory-gib` defaults to (an 80 GB H100 / A100)
DEFAULT_GPU_MEMORY_GIB = 80.0

WHY = {
    "ipc": "a worker on policy rank 0's GPU: CUDA IPC",
    "nccl": "on GPUs of its own: NCCL broadcast",
    "gloo": "gloo broadcast",
}


@dataclass(frozen=True)
class GpuCluster:
    """The cluster a plan is for: `nodes` node(s) of `gpus_per_node` GPUs of `gpu_memory_gib`."""

    gpus_per_node: int
    nodes: int = 1
    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1 or not self.gpu_memory_gib > 0:
            raise ValueError(f"a planned cluster needs GPUs, nodes and GPU memory above 0: {self}")

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s) of {self.gpu_memory_gib:g} GiB"

    def node_list(self, cpus: float) -> list[dict[str, Any]]:
        """The nodes as `placement.cluster_nodes()` gives them, each with `cpus` CPUs."""
        return [
            {"ip": f"node{n}", "id": f"node{n}", "resources": {"CPU": cpus, "GPU": float(self.gpus_per_node)}}
            for n in range(self.nodes)
        ]


@dataclass
class RunPlan:
    """The plan's lines, and the one line the run would stop with (None: it would start)."""

    lines: list[str] = field(default_factory=list)
    refusal: str | None = None


def plan_run(cfg: SkyliftConfig, gpu_defaults: list[str], cluster: GpuCluster) -> RunPlan:
    """Plan `cfg` (loaded for CUDA: `load_config_for(..., cuda=True)`, which set the keys
    `gpu_defaults`) on `cluster`."""
    out = RunPlan([f"GPU plan for {cluster.describe()} (nothing started; this machine's devices unused)"])
    values = ", ".join(f"{key}={_get(cfg, key)}" for key in gpu_defaults)
    out.lines.append(f"GPU defaults the run takes (keys not set): {values or 'none, every one is set'}")
    try:
        _plan(cfg, cluster, out)
    except (PlacementError, ColocationError, WeightSyncError) as exc:
        out.refusal = str(exc)
    return out


def _plan(cfg: SkyliftConfig, cluster: GpuCluster, out: RunPlan) -> None:
    t, g = cfg.trainer, cfg.generator
    model = _local_model(t.policy.model.path)
    plan: PlacementPlan | None = None
    shared: GpuShare | None = None
    if uses_ray(cfg):
        plan, shared = _placement(cfg, cluster, out)
    else:
        engines = (
            f"and {g.num_inference_engines} engine(s) run in the run's process"
            if g.run_engines_locally
            else "runs in the run's process (the engines are remote)"
        )
        out.lines.append(
            f"placement: no Ray (trainer.placement.backend={t.placement.backend}): the policy's rank 0 "
            f"{engines}, on its first GPU"
        )
        if g.run_engines_locally and not t.placement.colocate_all:  # the run's `awake_engine_fraction`
            sizing = _sizing_reference(t.policy.model.path, model)
            if sizing is None:
                out.lines.append(
                    f"memory: {t.policy.model.path} is a registry name not prepared here: the engines' share "
                    f"of the GPU beside the trainer is not planned (the run sizes it from the checkpoint)"
                )
            else:
                awake_engine_fraction(cfg, sizing, int(cluster.gpu_memory_gib * GIB), out.lines.append)
    colocation = colocation_plan(t.placement.colocate_all, cuda=True, local_engines=g.run_engines_locally)
    if colocation.message:
        out.lines.append(colocation.message)
    if colocation.sleep_engines:
        _memory_split(cfg, cluster, model, shared, out)
    _weight_sync(cfg, cluster, model, plan, shared, out)
    if plan is not None and g.run_engines_locally and g.inference_engine_tensor_parallel_size > 1:
        from skylift.cluster.engines import ray_executor_env

        tp = g.inference_engine_tensor_parallel_size
        for e in range(g.num_inference_engines):
            env = " ".join(f"{k}={v}" for k, v in ray_executor_env(plan, e, tp).items())
            out.lines.append(f"{engine_role(e)} (tensor parallel {tp}, vLLM's Ray executor): {env}")


def _placement(
    cfg: SkyliftConfig, cluster: GpuCluster, out: RunPlan
) -> tuple[PlacementPlan, GpuShare | None]:
    """The run's placement on `cluster`: groups, ranks and bundles, GPU sharing, whether it fits."""
    request = request_from_config(cfg, gpu=True)
    # a run that joins no cluster starts a Ray of its own on one machine, with the CPUs it needs
    joined = cluster.nodes > 1 or cfg.trainer.ray_address not in (None, "", "local")
    cpus = plan_placement(request).total().get("CPU", 0.0)
    nodes = cluster.node_list(cpus)
    plan, shared = shared_placement(request, nodes, joined)
    for group in plan.groups:
        out.lines.append(f"placement: {_describe_group(plan, group.name)}")
    if shared is not None:
        out.lines.append(shared.line)
        crowded = [r for r in request.roles() if request.world(r) > 1]
        crowded += ["an engine's tensor-parallel"] if request.engine_tp > 1 else []
        if crowded:  # Ray packs a group's bundles onto the first GPU with room (`ray_ranks`)
            out.lines.append(
                f"note: Ray packs a group's shared bundles onto one GPU, so {', '.join(crowded)} ranks would "
                "share one, which NCCL refuses: the run stops there in one line; set "
                "trainer.placement.colocate_all=true (one rank of every model and one engine per GPU)"
            )
    refusal = infeasible_message(plan, nodes)
    if refusal is not None:
        raise PlacementError(refusal)
    bundles = sum(len(g.bundles) for g in plan.groups)
    out.lines.append(
        f"fits on {cluster.describe()}: {bundles} bundle(s), {plan.total().get('GPU', 0.0):g} GPU(s) in all"
        + ("" if not joined else "; CPUs not checked (each node taken to have the CPUs asked for)")
    )
    if joined:  # `ray_start.start_ray_run` and the GPU defaults read the starting machine's CUDA
        out.lines.append(
            "note: the run plans GPU bundles and takes the GPU defaults only where the machine it starts "
            "on sees CUDA: start it on a GPU node (on a CPU-only head node it stops at start, saying so)"
        )
    return plan, shared


def _describe_group(plan: PlacementPlan, name: str) -> str:
    """`policy+ref: 4 x {CPU: 1, GPU: 1} PACK; policy ranks 0-3, ref ranks 0-3`."""
    index = next(i for i, g in enumerate(plan.groups) if g.name == name)
    shape = PlacementPlan(groups=(plan.groups[index],)).describe()
    ranks: dict[str, list[int]] = {}
    for bundle in plan.groups[index].members:
        for role, rank in bundle:
            ranks.setdefault(role, []).append(rank)
    who = ", ".join(f"{role} rank(s) {_span(r)}" for role, r in ranks.items())
    return f"{shape}; {who}"


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _local_model(path: str) -> str | None:
    """The model's directory on this machine (a registry name already prepared counts), or None."""
    from skylift.models.cache import model_dir
    from skylift.models.registry import is_prepared

    if _is_registry_name(path):
        return str(model_dir(path)) if is_prepared(path) else None
    local = Path(path).expanduser()
    return str(local) if local.is_dir() else None


def _sizing_reference(path: str, model: str | None) -> str | None:
    """What the memory split sizes the trainer from: the local directory, or a Hub id (its cached
    snapshot, else the Hub's safetensors count: `colocation.checkpoint_parameter_count`); None
    for a registry name not prepared here."""
    if model is not None:
        return model
    return None if _is_registry_name(path) else path


def _is_registry_name(path: str) -> bool:
    """Whether `path` names one of skylift's built-in models (`skylift models list`)."""
    from skylift.models import list_models

    return any(spec.name == path for spec in list_models())


def _memory_split(
    cfg: SkyliftConfig, cluster: GpuCluster, model: str | None, shared: GpuShare | None, out: RunPlan
) -> None:
    """colocate_all's split of each GPU between the trainer and the engines (the run's function)."""
    path = cfg.trainer.policy.model.path
    sizing = _sizing_reference(path, model)
    if sizing is None:
        out.lines.append(
            f"colocation: {path} is a registry name not prepared here, so its parameter count is unknown "
            "and the memory split is not planned (the run sizes the trainer from the checkpoint)"
        )
        return
    gpu_bytes = int(cluster.gpu_memory_gib * GIB)
    colocated_engine_fraction(cfg, sizing, gpu_bytes, out.lines.append)
    if shared is not None:
        out.lines.append(
            "colocation: the bundles share GPUs, and the split above is for one bundle per GPU: "
            "several bundles on one GPU leave their engines less"
        )


def _weight_sync(
    cfg: SkyliftConfig,
    cluster: GpuCluster,
    model: str | None,
    plan: PlacementPlan | None,
    shared: GpuShare | None,
    out: RunPlan,
) -> None:
    """Which transport each engine gets and why, where the layout decides it."""
    from skylift.cluster.lora_run import lora_sync
    from skylift.weight_sync.factory import check_backend, placed_rule, transport_kind
    from skylift.weight_sync.placed import resolve, split

    g = cfg.generator
    check_backend(cfg, cuda=True)  # the run's refusal from the config alone, at the sync's start
    adapter = cfg.trainer.policy.model.lora.rank > 0
    if adapter and model is not None:
        lora = lora_sync(cfg, model)
        adapter = lora.adapter
        if lora.line:
            out.lines.append(lora.line)
    elif adapter:
        out.lines.append(
            "LoRA: the adapter is synced unless the model is a mixture of experts (not here to tell)"
        )
    kind = transport_kind(cfg, adapter)
    if kind == "delta":
        out.lines.append(f"weight sync: checkpoint deltas through {g.delta_weight_sync.sync_dir}")
        return
    rule = placed_rule(cfg)
    if kind == "lora":  # the adapter's group, chosen from the places as full weights are (`placed`)
        if not g.run_engines_locally or shared is not None:
            out.lines.append(
                "weight sync: the LoRA adapter over a group chosen at run time from where the ranks are "
                "(gloo where an engine shares rank 0's GPU, NCCL where every engine has GPUs of its own)"
            )
            return
        transport, why = resolve(rule, *_places(cfg, cluster, plan))
        backend = "gloo" if transport == "ipc" else transport
        out.lines.append(f"weight sync: the LoRA adapter over a {backend} group ({why})")
        return
    if not g.run_engines_locally:
        out.lines.append(
            f"weight sync ({rule}): decided at run time from the places the remote engines report"
        )
        return
    if shared is not None:
        out.lines.append(
            f"weight sync ({rule}): decided at run time: which ranks share a GPU is Ray's choice (CUDA IPC "
            "for an engine on rank 0's GPU, NCCL for engines on GPUs of their own, both for a mix)"
        )
        return
    if plan is not None and cluster.nodes > 1 and not cfg.trainer.placement.colocate_all and rule == "ipc":
        out.lines.append(
            "weight sync (ipc): works only for engines Ray puts on rank 0's node; checked when the sync opens"
        )
        return
    trainer, engines = _places(cfg, cluster, plan)
    transport, why = resolve(rule, trainer, engines)
    if rule != "auto":
        out.lines.append(f"weight sync: {transport}, {why}")
        return
    choices = choose_transports(trainer, engines)
    per = ", ".join(
        f"engine(s) {_span([e for e, c in enumerate(choices) if c == kind])}: {kind} ({WHY[kind]})"
        for kind in sorted(set(choices))
    )
    mixed = "" if len(set(choices)) == 1 else f"; all engines take {transport} (one group carries both)"
    if (parts := split(choices)) is not None:  # `PlacedTransport`: each engine its own way
        ipc, backend, rest = parts
        mixed = f"; each its own way: ipc for engine(s) {_span(ipc)}, one {backend} group for engine(s) {_span(rest)}"
    out.lines.append(f"weight sync (auto): {per}{mixed}")


def _places(
    cfg: SkyliftConfig, cluster: GpuCluster, plan: PlacementPlan | None
) -> tuple[Place, list[list[Place]]]:
    """The places the plan gives policy rank 0 and each engine's workers: a GPU per one-GPU bundle
    (the ranks that share a bundle share its GPU); without Ray, this process's GPUs."""
    g = cfg.generator
    tp = g.inference_engine_tensor_parallel_size
    if plan is None:  # in-process engines: TP rank r on the process's GPU r, rank 0 on GPU 0
        return Place("node0", "cuda", "0"), [
            [Place("node0", "cuda", str(r)) for r in range(tp)] for _ in range(g.num_inference_engines)
        ]

    def place(role: str, rank: int) -> Place:
        slot = plan.slot(role, rank)
        # a colocated (PACK) group is taken to fill the nodes in order; other groups' engines stay
        # on one node (STRICT_PACK), and which one does not change the choice between GPUs
        node = slot.bundle // cluster.gpus_per_node if plan.groups[slot.group].name == "colocate_all" else 0
        return Place(f"node{node}", "cuda", f"{plan.groups[slot.group].name}/{slot.bundle}")

    engines = [[place(engine_role(e), r) for r in range(tp)] for e in range(g.num_inference_engines)]
    return place("policy", 0), engines


def _get(cfg: SkyliftConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
