"""The one place that knows every transport: `make_transport` (a run's config picks how weights
reach its engines: the driver's half) and `ENGINE_SIDES` (every transport's engine half)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, Literal

from skylift.config.schema import SkyliftConfig
from skylift.config.validation import overrides_update_group
from skylift.weight_sync.broadcast.engine import BroadcastEngineSide
from skylift.weight_sync.broadcast.tensors import TensorsTransport
from skylift.weight_sync.broadcast.transport import BroadcastTransport
from skylift.weight_sync.delta.engine import DeltaEngineSide
from skylift.weight_sync.delta.transport import DeltaTransport
from skylift.weight_sync.engine_side import EngineHost, EngineSide, EngineSides, WeightCall
from skylift.weight_sync.ipc.engine import IpcEngineSide
from skylift.weight_sync.ipc.policy_transport import PolicySharedTransport
from skylift.weight_sync.ipc.transport import SharedTensorsTransport
from skylift.weight_sync.lora.engine import LoraEngineSide
from skylift.weight_sync.lora.transport import LoraTransport
from skylift.weight_sync.placed import PlacedTransport
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.protocol import DeltaPublishSpec
from skylift.weight_sync.topology import Place, check_forced, choose_transports
from skylift.weight_sync.transport import EngineSet, Say, WeightTransport

#: whether the shared-memory transport keeps its buffers between pushes and streams into them
#: (`ipc.policy_rank`); CUDA buffers are never kept. `benchmarks/weight_sync.py` (2 shared cores):
#: SmolLM2-135M kept 0.64 of the gloo stream's time, new buffers 1.70; tiny-qwen2 (4 MB) kept
#: 1.71 (18 ms more per sync), new buffers 4.49
KEEP_SHARED_BUFFERS = True


def lora_sync_path(cfg: SkyliftConfig) -> str | None:
    """The directory a LoRA policy's syncs hand the adapter over through (None: in memory):
    `generator.lora_sync_path`, or its other name `trainer.policy.model.lora.lora_sync_path`
    (validation refuses the two naming different directories)."""
    return cfg.generator.lora_sync_path or cfg.trainer.policy.model.lora.lora_sync_path or None


def _engines_share_the_policys_gpu(cfg: SkyliftConfig, cuda: bool | None) -> bool:
    """Whether the run's own engines share the policy's GPUs (``colocate_all``, or everything in
    this process) on a CUDA host (`cuda`: None, this process's)."""
    placement = cfg.trainer.placement
    shared = cfg.generator.run_engines_locally and (placement.colocate_all or placement.backend == "local")
    if not shared:
        return False
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return bool(cuda)


def check_backend(cfg: SkyliftConfig, cuda: bool | None = None) -> None:
    """Refuse at start, in one line (`topology.check_forced`), a forced `weight_sync_backend` that
    cannot work where the config puts the ranks: engines started by the run that share the
    policy's GPUs (``colocate_all``, or everything in this process) on a CUDA host (`cuda`: None,
    this process's) put the policy's rank 0 and an engine worker on one GPU, which NCCL refuses."""
    if cfg.generator.weight_sync_backend == "nccl" and _engines_share_the_policys_gpu(cfg, cuda):
        gpu = Place(socket.gethostname(), "cuda", "0")
        check_forced("nccl", gpu, [[gpu]])


def group_backend(cfg: SkyliftConfig, cuda: bool | None = None) -> str | None:
    """The weight-update group's backend where the config alone decides (a LoRA policy's group,
    and full weights to engines that cannot say where they run): a forced one as given; ``auto``
    where the run's engines share the policy's GPU: gloo (NCCL refuses two ranks on one GPU);
    else None (a group's ``auto``: gloo on CPU, NCCL on GPU, decided on the policy's rank 0)."""
    backend = cfg.generator.weight_sync_backend
    if backend not in ("auto", "delta"):
        return backend
    return "gloo" if _engines_share_the_policys_gpu(cfg, cuda) else None


def transport_kind(cfg: SkyliftConfig, lora_adapter: bool = True) -> Literal["delta", "lora", "placed"]:
    """Which transport `make_transport` builds: ``delta`` (`weight_sync_backend=delta` with a
    sync_dir), ``lora`` (a LoRA policy syncing its adapter, `lora_adapter`, over a group:
    `group_backend`) or ``placed`` (full weights, the transport picked from the ranks' places under
    `placed_rule`). A forced ``ipc`` for a LoRA adapter is refused (`WeightSyncError`, one line)."""
    g = cfg.generator
    if g.weight_sync_backend == "delta" and g.delta_weight_sync.sync_dir:
        return "delta"
    if cfg.trainer.policy.model.lora.rank > 0 and lora_adapter:
        if g.weight_sync_backend == "ipc":
            raise WeightSyncError(
                "weight_sync_backend=ipc carries full weights, and a LoRA policy syncs its adapter over a "
                "group or a directory: use weight_sync_backend=auto (or gloo/nccl)"
            )
        return "lora"
    return "placed"


def placed_rule(cfg: SkyliftConfig) -> str:
    """The rule `PlacedTransport` applies at open: ``auto``, or the forced backend."""
    backend = cfg.generator.weight_sync_backend
    return "auto" if backend in ("auto", "delta") else backend


def make_transport(
    cfg: SkyliftConfig, policy: Any, engines: EngineSet, say: Say, *, lora_adapter: bool = True
) -> WeightTransport:
    """`weight_sync_backend=delta` (with a sync_dir): `DeltaTransport`; a LoRA policy syncing its
    adapter (`lora_adapter`): `LoraTransport`, its group chosen at open as below (gloo where an
    engine shares rank 0's GPU or host); full
    weights (a LoRA policy's merged in where its engines cannot serve the adapter): `PlacedTransport`,
    which picks at open, from where rank 0 and the engines' workers say they run
    (`weight_sync.topology`), `PolicySharedTransport` (``ipc``: CUDA IPC / shared memory on the
    policy's host) or `BroadcastTransport` (a gloo or NCCL group), or both for a mix (each over
    its engines: `weight_sync.mixed`). A forced backend that cannot
    work is refused: from the config alone here (`check_backend`), from the places at open."""
    check_backend(cfg)
    kind = transport_kind(cfg, lora_adapter)
    g = cfg.generator
    dtype = None if g.model_dtype == "auto" else g.model_dtype  # None: sent as trained
    d = g.delta_weight_sync
    if kind == "delta":
        spec = DeltaPublishSpec(
            d.sync_dir,
            int(d.max_file_size_in_gb * (1 << 30)),
            d.publish_num_workers,
            d.publish_staging_dir,
            d.rebase_interval,
        )
        return DeltaTransport(
            policy,
            engines,
            spec,
            dtype=dtype,
            store_dir=d.local_checkpoint_dir,
            download_workers=d.cloud_download_workers,
        )
    group = {
        "dtype": dtype,
        "backend": group_backend(cfg),
        "timeout_s": g.weight_sync_timeout_s,
        # None: derived on the policy's rank 0 (see RLWorker.host_weight_group)
        "master_address": g.weight_sync_master_address,
        "override_existing": overrides_update_group(g.override_existing_update_group),
    }
    if kind == "lora":  # the adapter's group: by where the ranks are, as full weights (`placed`)

        def build_adapter(choice: str | None, served: EngineSet) -> WeightTransport:
            backend = choice if choice is not None else group["backend"]
            return LoraTransport(
                policy, served, say, sync_path=lora_sync_path(cfg), **{**group, "backend": backend}
            )

        return PlacedTransport(
            placed_rule(cfg), policy, engines, say, build_adapter, dtype=dtype, adapter=True
        )

    def build(choice: str | None, served: EngineSet) -> WeightTransport:
        """The transport for `choice` over `served` (every engine, or one part of a mix)."""
        if choice == "ipc":
            return PolicySharedTransport(policy, served, say, dtype=dtype, keep_buffers=KEEP_SHARED_BUFFERS)
        backend = choice if choice is not None else group["backend"]
        return BroadcastTransport(policy, served, say, **{**group, "backend": backend})

    return PlacedTransport(placed_rule(cfg), policy, engines, say, build, dtype=dtype)


#: The engine half of every transport, by the name `weight_call` addresses it with
#: (`weight_sync.engine_side`). A new transport adds its `EngineSide` here.
ENGINE_SIDES: dict[str, type[EngineSide]] = {
    BroadcastEngineSide.transport: BroadcastEngineSide,
    LoraEngineSide.transport: LoraEngineSide,
    DeltaEngineSide.transport: DeltaEngineSide,
    IpcEngineSide.transport: IpcEngineSide,
}

#: The worker half of each transport that keeps one as an object (`weight_sync.worker_side`), by
#: dotted path (imported in the vLLM worker on first use).
WORKER_RECEIVERS: dict[str, str] = {
    IpcEngineSide.transport: "skylift.weight_sync.ipc.receiver.IpcWorkerReceiver",
}


def make_engine_sides(host: EngineHost) -> EngineSides:
    """Every transport's engine half for one engine (`LocalVLLMEngine`), sharing its weight state."""
    return EngineSides(host, ENGINE_SIDES)


def local_tensors_transport(engines: Sequence[WeightCall]) -> WeightTransport:
    """Full weights this process holds in host memory -> engines it started on its own host (the
    Tinker sampler's), by the transport `topology.choose_transport` picks for those places:
    shared memory (`ipc.transport.SharedTensorsTransport`) where every engine shares the host,
    else the weight-update group this process hosts (`broadcast.tensors.TensorsTransport`)."""
    here = Place(socket.gethostname())
    choices = choose_transports(here, [[here] for _ in engines])
    if all(c == "ipc" for c in choices):
        return SharedTensorsTransport(engines)
    return TensorsTransport(engines)  # type: ignore[arg-type]
