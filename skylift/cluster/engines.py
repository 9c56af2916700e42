"""Inference engines for a training run: local (vLLM in Ray actors) or remote (HTTP servers).

A Ray engine is an `EngineActor` reached through a `RayEngineClient` (`inference.ray_engine`).
`EngineRef`s are small picklable descriptions that the driver turns into `InferenceEngine`
clients with `connect()` (the pool's clients, which weight sync uses too: `weight_sync.policy_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.cluster.placement import PlacedGroups, PlacementPlan, engine_role
from skylift.cluster.ray_ranks import check_ranks_on_distinct_gpus
from skylift.inference.ray_engine import EngineActor, RayEngineClient
from skylift.inference.types import EngineUnavailableError


@dataclass
class EngineRef:
    """How to reach one engine from any process: a Ray actor or an HTTP server URL."""

    name: str
    engine: Any = None  # an in-process engine (placement backend "local")
    actor: Any = None
    url: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    host: str | None = None  # the node IP a Ray engine actor reported

    def connect(self) -> Any:
        if self.engine is not None:
            return self.engine
        if self.actor is not None:
            return RayEngineClient(self.actor, self.name, self.timeout_s)
        from skylift.inference.remote import RemoteInferenceEngine

        assert self.url is not None
        return RemoteInferenceEngine(self.url, api_key=self.api_key, timeout_s=self.timeout_s)


def start_local_engines(
    count: int,
    model: str,
    engine_kwargs: dict[str, Any],
    num_cpus: float = 0,
    startup_timeout_s: float = 900.0,
    call_timeout_s: float = 600.0,
    placement: PlacedGroups | None = None,
) -> list[EngineRef]:
    """Start `count` vLLM engines as Ray actors; blocks until all are up (they start in parallel).

    With `placement`, engine i runs on the bundles of role `engine-i` (its tensor-parallel ranks
    on one node; on GPU, TP > 1 engines hand their bundles to vLLM's Ray executor). An engine not
    up within `startup_timeout_s` fails the start naming it (all are stopped).
    """
    import ray

    actor_cls = ray.remote(num_cpus=num_cpus)(EngineActor)
    tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
    if placement is None:
        actors = [actor_cls.options(name=None).remote() for _ in range(count)]
    else:
        for i in range(count):  # vLLM's tensor-parallel workers form an NCCL group
            who = f"{engine_role(i)}'s tensor-parallel"
            check_ranks_on_distinct_gpus(
                placement, engine_role(i), tp, who, "generator.inference_engine_tensor_parallel_size"
            )
        actors = [actor_cls.options(**_engine_options(placement, i, tp)).remote() for i in range(count)]
        if tp > 1 and placement.plan.groups and "GPU" in placement.plan.groups[0].bundles[0]:
            engine_kwargs = {**engine_kwargs, "distributed_executor_backend": "ray"}
    starts = []
    for i, actor in enumerate(actors):
        kwargs = dict(engine_kwargs)
        kwargs.setdefault("name", f"engine-{i}")
        starts.append(actor.start.remote(model, kwargs))
    _, pending = ray.wait(starts, num_returns=len(starts), timeout=startup_timeout_s)
    if pending:
        late = [i for i, ref in enumerate(starts) if ref in pending]
        for actor in actors:
            ray.kill(actor)
        raise EngineUnavailableError(
            f"local engine(s) {late} not up within {startup_timeout_s:.0f} s "
            "(generator.engine_startup_timeout_s); all engines were stopped"
        )
    names = ray.get(starts)
    hosts = ray.get([actor.node_ip.remote() for actor in actors], timeout=60)
    return [
        EngineRef(name=str(name), actor=actor, timeout_s=call_timeout_s, host=str(host))
        for name, actor, host in zip(names, actors, hosts, strict=True)
    ]


def _engine_options(placement: PlacedGroups, index: int, tp: int) -> dict[str, Any]:
    """Actor options of engine `index`: its rank-0 bundle; with TP > 1 on GPU the actor takes no
    GPU itself and vLLM's Ray executor places the ranks on the engine's bundles
    (`ray_executor_env`, in the actor's environment, which vLLM's engine process inherits)."""
    role = engine_role(index)
    options = placement.options(role, 0, capture_child_tasks=tp > 1)
    if tp > 1 and options.get("num_gpus"):
        options["num_gpus"] = 0
        options["runtime_env"] = {"env_vars": ray_executor_env(placement.plan, index, tp)}
    return options


def ray_executor_env(plan: PlacementPlan, index: int, tp: int) -> dict[str, str]:
    """What vLLM's Ray executor needs to place engine `index`'s `tp` GPU workers on the engine's
    bundles: their indices in its placement group (`VLLM_RAY_BUNDLE_INDICES`; under colocate_all
    the engines share one group, engine i on bundles i*tp ... i*tp+tp-1) and the GPU share each
    worker asks for (`VLLM_RAY_PER_WORKER_GPUS`, 1.0 by default in vLLM: a colocated bundle holds
    one GPU shared with the training ranks, so each takes its share of it)."""
    slots = [plan.slot(engine_role(index), rank) for rank in range(tp)]
    shares = {slot.resources.get("GPU", 0.0) for slot in slots}
    if len(shares) != 1 or not next(iter(shares)):
        raise ValueError(
            f"engine {index}'s ranks must each hold an equal share of a GPU, got {sorted(shares)}"
        )
    return {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(str(slot.bundle) for slot in slots),
        "VLLM_RAY_PER_WORKER_GPUS": f"{shares.pop():.6g}",
    }


async def start_inprocess_engines(count: int, model: str, engine_kwargs: dict[str, Any]) -> list[EngineRef]:
    """Start `count` vLLM engines in this process (their engine cores are child processes)."""
    from skylift.inference.local import LocalVLLMEngine

    refs = []
    for i in range(count):
        engine = await LocalVLLMEngine.create(model, **{"name": f"engine-{i}", **engine_kwargs})
        refs.append(EngineRef(name=repr(engine), engine=engine))
    return refs


def remote_engine_refs(urls: list[str], api_key: str | None, timeout_s: float) -> list[EngineRef]:
    return [EngineRef(name=url, url=url, api_key=api_key, timeout_s=timeout_s) for url in urls]
