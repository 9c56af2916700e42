"""Training workers of a run: FSDP2 ranks as Ray actors (or one in-process rank), plus weight sync.

`RLWorker` adds to `TrainingWorker` the one RL-specific duty of the policy: producing and
broadcasting its weights for the inference engines (the driver tells the engines to receive).
`WorkerGroup` starts the ranks, shards batches over them and calls their methods in lockstep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from skylift.algorithms.sample_support import Sampling
from skylift.cluster.placement import PlacedGroups
from skylift.cluster.ray_ranks import (
    WEIGHT_CONTROL,
    check_ranks_on_distinct_gpus,
    file_rendezvous,
    rank_actor_class,
    rendezvous,
    wait_for_ranks,
)
from skylift.models.checkpoint_names import CheckpointNames, checkpoint_names_for
from skylift.weight_sync.broadcast.broadcaster import WeightBroadcaster
from skylift.weight_sync.buckets import str_to_dtype
from skylift.weight_sync.ipc.policy_rank import SharedWeightsRank
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.protocol import DeltaPublishSpec, WeightBucket
from skylift.worker.batch import SequenceBatch
from skylift.worker.lora import base_name
from skylift.worker.offload import OffloadingWorker
from skylift.worker.training_worker import LossFn, TrainingWorker, WorkerSettings

# Bucket size of the policy's weight syncs. Each engine's worker keeps two buckets' worth of
# receive memory between syncs (`BufferArena`; the sender's arenas hold only the small tensors it
# coalesces), so a smaller bucket keeps less resident, with the same sync time, since the stream
# loads bucket k while bucket k+1 travels (the demo's figures: benchmarks/RESULTS.md).
SYNC_BUCKET_MB = 64

logger = logging.getLogger("skylift.cluster.worker_group")

R = TypeVar("R")


class RLWorker(OffloadingWorker, TrainingWorker, SharedWeightsRank):
    """A training rank that also produces the policy's weights for the inference engines, and
    whose state can wait in host memory while colocated engines are awake (`OffloadingWorker`).

    Every rank gathers (a collective); rank 0 alone is in the weight-update group and broadcasts
    (`WeightBroadcaster`), or shares the weights by handle with engines on its host
    (`SharedWeightsRank`). No rank calls an engine: the driver (`weight_sync.policy_sync`) tells the
    engines to join and to receive while rank 0 runs the matching call here.
    """

    def __init__(self, *args: Any, node_ip: str | None = None, **kwargs: Any) -> None:
        """`node_ip`: the IP of the node this rank runs on (None: Ray's, or 127.0.0.1 without Ray)."""
        super().__init__(*args, **kwargs)
        self._node_ip = node_ip
        self.broadcaster: WeightBroadcaster | None = None
        self._staged: list[Tensor] = []  # a LoRA adapter's packed buffers, until it is broadcast
        self._peft_config: dict[str, Any] = {}
        self.delta_publisher: Any = None  # weight_sync_backend=delta: rank 0's DeltaPublisher
        self._checkpoint_names: CheckpointNames | None = None  # rank 0's, built on the first sync

    def node_ip(self) -> str:
        """The address of this rank's node as the cluster knows it (127.0.0.1 without Ray)."""
        if self._node_ip is None:
            import ray

            self._node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return self._node_ip

    def host_weight_group(
        self,
        world_size: int,
        remote_urls: Sequence[str],
        backend: str | None = None,
        timeout_s: float = 120.0,
        master_address: str | None = None,
    ) -> tuple[str, int, str] | None:
        """Host the weight-update group's store (rank 0 only): (address, port, backend) for the
        engines to dial. `master_address`: `generator.weight_sync_master_address`; None = this
        node's IP for local engines, or this host's address on the route to the first remote
        engine (`remote_urls`)."""
        if self.rank != 0:
            return None
        from skylift.weight_sync.broadcast.sender import weight_sync_master_address

        self.close_weight_group()
        address = weight_sync_master_address(master_address, list(remote_urls), self.node_ip())
        self.broadcaster = WeightBroadcaster(timeout_s=timeout_s, update_timeout_s=timeout_s)
        port = self.broadcaster.host(address, world_size, backend)  # type: ignore[arg-type]
        return address, port, self.broadcaster.backend

    def join_weight_group(self) -> None:
        """Rank 0's rendezvous of the hosted group (blocks until the engines joined)."""
        if self.rank == 0:
            self._require_broadcaster().join()

    def broadcast_weights(
        self, bucket_mb: int = SYNC_BUCKET_MB, dtype: str | None = None
    ) -> dict[str, float]:
        """Gather the full weights (every rank: a collective) and broadcast them as one weight
        stream (rank 0) while the engines receive it.

        `dtype`: the engines' weight dtype (e.g. "bfloat16" engines of a float32 policy); floating
        tensors are cast to it before sending, so half the bytes travel. None sends them as they are.
        """
        started = time.perf_counter()
        weights = self.engine_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return {}
        broadcaster = self._require_broadcaster()
        if dtype is not None:  # only the sending rank pays for the cast
            weights = _cast_floating(weights, str_to_dtype(dtype))
        sent = broadcaster.broadcast_stream(weights, bucket_bytes=bucket_mb << 20)
        return {"timing/weight_sync_s": time.perf_counter() - started, "weight_sync/bytes": float(sent.bytes)}

    def engine_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The full weights (every rank: a collective) as the engines load them: rank 0's under the
        checkpoint's names and layouts (`models.checkpoint_names`: a mixture-of-experts layer's
        fused experts back to one tensor per expert), the other ranks' as they are (they drop them)."""
        weights = self.iter_full_weights()
        if self.rank != 0:
            return weights
        return self._names().convert(weights)

    def engine_weight_layout(self) -> list[tuple[str, Tensor]] | None:
        """What `engine_weights` yields on rank 0 as meta tensors, gathering nothing; None where it
        cannot be known so (a conversion needs real values). A LoRA policy's are its base's, the
        adapter merged in (`merged_lora_weights`)."""
        state = self._model().state_dict()  # a DTensor's shape is the full one
        if self.settings.lora_rank > 0:
            state = {base_name(n): t for n, t in state.items() if "lora_" not in n}
        meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in state.items())
        try:
            return list(self._names().convert(meta))
        except Exception as exc:  # noqa: BLE001 - the gathered path still works
            logger.info("the engines' weight layout is not known before gathering: %r", exc)
            return None

    def _names(self) -> CheckpointNames:
        if self._checkpoint_names is None:
            model = self._model()
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            self._checkpoint_names = checkpoint_names_for(base, self.settings.model_path)
        return self._checkpoint_names

    def publish_delta(self, spec: DeltaPublishSpec, dtype: str | None = None) -> dict[str, float]:
        """Gather the full weights (every rank: a collective) and publish them as the next
        checkpoint-delta version under `spec.sync_dir` (rank 0; `weight_sync.delta.publish`).
        Returns rank 0's metrics, among them the version published."""
        weights = self.engine_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return {}
        if self.delta_publisher is None:
            from skylift.weight_sync.delta.format import resolve_base_dir
            from skylift.weight_sync.delta.publish import DeltaPublisher

            self.delta_publisher = DeltaPublisher(
                spec.sync_dir,
                resolve_base_dir(self.settings.model_path),
                max_file_bytes=spec.max_file_bytes,
                num_workers=spec.num_workers,
                staging_dir=spec.staging_dir,
                rebase_interval=spec.rebase_interval,
            )
        if dtype is not None:
            weights = _cast_floating(weights, str_to_dtype(dtype))
        return self.delta_publisher.publish(weights).metrics()

    def _adapter(self, dtype: str | None) -> list[tuple[str, Tensor]] | None:
        """The LoRA adapter's tensors (cast to `dtype`) on rank 0, None elsewhere (a collective)."""
        from skylift.weight_sync.lora.adapter import cast_floating

        tensors, self._peft_config = self.lora_adapter()
        if self.rank != 0:
            return None
        return cast_floating(tensors, str_to_dtype(dtype) if dtype else None)

    def stage_lora_adapter(self, dtype: str | None = None) -> tuple[WeightBucket, dict[str, Any]] | None:
        """Gather the LoRA adapter (every rank) and pack it for `broadcast_lora_adapter` (rank 0):
        its bucket metadata and PEFT config, for the driver to hand to the engines."""
        from skylift.weight_sync.buckets import bucket_of
        from skylift.weight_sync.lora.adapter import pack_adapter

        tensors = self._adapter(dtype)
        if tensors is None:
            return None
        self._staged = pack_adapter(tensors, self._require_broadcaster().require_group().device)
        return bucket_of(tensors), self._peft_config

    def broadcast_lora_adapter(self) -> int:
        """Broadcast the staged adapter (rank 0) while the engines receive it; the bytes sent."""
        if self.rank != 0:
            return 0
        staged, self._staged = self._staged, []
        return self._require_broadcaster().broadcast_buffers(staged)

    def write_lora_adapter(self, directory: str, dtype: str | None = None) -> tuple[int, int] | None:
        """Gather the LoRA adapter (every rank) and write it to `directory` in PEFT's layout (rank
        0): its tensor count and bytes."""
        from skylift.weight_sync.lora.adapter import adapter_nbytes, write_adapter_dir

        tensors = self._adapter(dtype)
        if tensors is None:
            return None
        write_adapter_dir(directory, tensors, self._peft_config)
        return len(tensors), adapter_nbytes(tensors)

    def close_weight_group(self) -> None:
        """Leave the weight-update group (the engines left theirs first; idempotent)."""
        broadcaster, self.broadcaster = self.broadcaster, None
        if broadcaster is not None:
            broadcaster.close()

    def _require_broadcaster(self) -> WeightBroadcaster:
        if self.broadcaster is None:
            raise WeightSyncError("no weight-update group on the policy's rank 0: host it first")
        return self.broadcaster


def _cast_floating(weights: Iterator[tuple[str, Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in weights:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


class WorkerGroup:
    """`world_size` ranks of one model; Ray actors when `use_ray`, else one in-process rank."""

    def __init__(
        self,
        name: str,
        settings: WorkerSettings,
        world_size: int = 1,
        use_ray: bool = True,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        timeout_s: float = 3600.0,
        placement: PlacedGroups | None = None,
        role: str | None = None,
        worker_cls: type[TrainingWorker] = RLWorker,
    ) -> None:
        """`timeout_s`: the longest one call to the Ray workers may take (in-process calls cannot
        be interrupted; their collectives have the process group's own timeout).

        `placement`: the run's placement groups; rank r goes on the bundle of (`role`, r) (role
        defaults to `name`). The ranks meet over a file on one host, or over TCP at rank 0's node
        IP (MASTER_ADDR) when any rank runs on another node. `worker_cls`: the ranks' class, a
        `TrainingWorker` (the supervised stages' `SupervisedWorker`; default the policy's).
        """
        self.name = name
        self.worker_cls = worker_cls
        self.world_size = world_size
        self.use_ray = use_ray
        self.timeout_s = timeout_s
        self.node_ips: list[str] = []
        if use_ray:
            cls = rank_actor_class(worker_cls, num_cpus_per_worker, num_gpus_per_worker)
            if placement is not None:
                role = role or name
                key = f"trainer.placement.{role}_num_gpus_per_node"
                check_ranks_on_distinct_gpus(placement, role, world_size, name, key)  # NCCL's rule
                self.node_ips = [placement.node_ip(role, r) for r in range(world_size)]
                init_method = rendezvous(name, placement, role, self.node_ips)
                self.workers: list[Any] = [
                    cls.options(**placement.options(role, rank)).remote(
                        settings, rank, world_size, init_method, node_ip=self.node_ips[rank]
                    )
                    for rank in range(world_size)
                ]
            else:
                init_method = file_rendezvous(name)
                self.workers = [
                    cls.remote(settings, rank, world_size, init_method) for rank in range(world_size)
                ]
        else:
            init_method = file_rendezvous(name)
            if world_size != 1:
                raise ValueError(f"{name}: more than one worker needs Ray (world_size={world_size})")
            self.workers = [worker_cls(settings, 0, 1, init_method)]

    def _call(
        self,
        method: Callable[..., R],
        per_rank_args: Sequence[tuple] | None = None,
        *args: Any,
        ranks: int | None = None,
        concurrency_group: str | None = None,
        **kwargs: Any,
    ) -> list[R]:
        """`method` (an `RLWorker` method) on the first `ranks` ranks (None: all), with
        `per_rank_args[r]` or `args`; results in rank order. `concurrency_group`: the actors' group
        that runs it (`ray_ranks.WEIGHT_CONTROL`; None: the default, one call at a time)."""
        name = method.__name__
        workers = self.workers[:ranks]
        if self.use_ray:
            calls = [getattr(w, name) for w in workers]
            if concurrency_group is not None:
                calls = [c.options(concurrency_group=concurrency_group) for c in calls]
            refs = [
                c.remote(*(per_rank_args[r] if per_rank_args else args), **kwargs)
                for r, c in enumerate(calls)
            ]
            return wait_for_ranks(refs, f"{self.name} worker", name, self.timeout_s)
        return [method(workers[0], *(per_rank_args[0] if per_rank_args else args), **kwargs)]

    def call_all(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """`method` (an `RLWorker` method, e.g. `RLWorker.setup`) on every rank, in lockstep."""
        return self._call(method, None, *args, **kwargs)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple]) -> list[R]:
        """`method` on every rank in lockstep, rank r with the arguments `per_rank_args[r]`."""
        return self._call(method, per_rank_args)

    def call_rank0(self, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`method` on rank 0 alone (what only the weight-update group's rank 0 does)."""
        return self._call(method, None, *args, ranks=1, **kwargs)[0]

    def shards(self, batch: SequenceBatch) -> list[SequenceBatch]:
        """Rows of `batch` split into `world_size` contiguous, near-equal shards."""
        n = batch.batch_size
        bounds = [round(r * n / self.world_size) for r in range(self.world_size + 1)]
        return [batch.select(list(range(bounds[r], bounds[r + 1]))) for r in range(self.world_size)]

    def setup(self) -> list[dict[str, Any]]:
        return self.call_all(RLWorker.setup)

    # ---- the policy's side of weight sync (every rank gathers; rank 0 broadcasts; the driver,
    # `weight_sync.policy_sync`, calls these while it tells the engines to join and receive)
    def host_weight_group(
        self,
        world_size: int,
        remote_urls: Sequence[str],
        backend: str | None,
        timeout_s: float,
        master_address: str | None,
    ) -> tuple[str, int, str]:
        """Rank 0 hosts the group's store: (address, port, backend) the engines dial."""
        hosted = self.call_rank0(
            RLWorker.host_weight_group, world_size, remote_urls, backend, timeout_s, master_address
        )
        assert hosted is not None
        return hosted

    def join_weight_group(self) -> None:
        self.call_rank0(RLWorker.join_weight_group)

    def broadcast_weights(self, dtype: str | None) -> dict[str, float]:
        """Every rank gathers the full weights, rank 0 broadcasts them (rank 0's metrics)."""
        return self.call_all(RLWorker.broadcast_weights, dtype=dtype)[0]

    def publish_delta(self, spec: DeltaPublishSpec, dtype: str | None) -> dict[str, float]:
        """Every rank gathers the full weights, rank 0 publishes the next delta version."""
        return self.call_all(RLWorker.publish_delta, spec, dtype)[0]

    def stage_lora_adapter(self, dtype: str | None) -> tuple[WeightBucket, dict[str, Any]]:
        staged = self.call_all(RLWorker.stage_lora_adapter, dtype)[0]
        assert staged is not None
        return staged

    def broadcast_lora_adapter(self) -> int:
        return self.call_rank0(RLWorker.broadcast_lora_adapter)

    def write_lora_adapter(self, directory: str, dtype: str | None) -> tuple[int, int]:
        written = self.call_all(RLWorker.write_lora_adapter, directory, dtype)[0]
        assert written is not None
        return written

    def close_weight_group(self) -> None:
        """Rank 0 leaves the group; it runs beside a `join_weight_group` still waiting (which it
        ends), not behind it (`ray_ranks.WEIGHT_CONTROL`)."""
        self._call(RLWorker.close_weight_group, None, ranks=1, concurrency_group=WEIGHT_CONTROL)

    # ---- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its shard of the model and optimizer state under `path`."""
        self.call_all(RLWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.call_all(RLWorker.load_checkpoint, path)

    def export_hf(self, path: str) -> str:
        """The model as a Hugging Face directory at `path` (LoRA merged); returns the path."""
        return str(self.call_all(RLWorker.export_hf, path)[0])

    def compute_logprobs(self, batch: SequenceBatch, micro_batch_size: int, temperature: Sampling) -> Any:
        return self._per_token(RLWorker.compute_logprobs, batch, micro_batch_size, temperature)

    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> Any:
        return self._per_token(RLWorker.compute_values, batch, micro_batch_size)

    def _per_token(self, method: Callable[..., Tensor], batch: SequenceBatch, *args: Any) -> Any:
        """`[B, R]` results of a per-token worker method, the batch sharded over the ranks."""
        import torch

        if self.world_size == 1:
            return self.call_all(method, batch, *args)[0]
        shards = self.shards(batch)
        outs = self._call(method, [(s, *args) for s in shards])
        full = torch.zeros(batch.batch_size, batch.response_len)
        start = 0
        for shard, out in zip(shards, outs, strict=True):
            full[start : start + shard.batch_size, : out.shape[1]] = out
            start += shard.batch_size
        return full

    def train_mini_batch(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        temperature: Sampling,
    ) -> dict[str, float]:
        shards = self.shards(batch) if self.world_size > 1 else [batch]
        results = self._call(
            RLWorker.train_mini_batch, [(s, loss_fn, micro_batch_size, temperature) for s in shards]
        )
        merged: dict[str, float] = {}
        for key in results[0]:
            merged[key] = sum(r[key] for r in results) / len(results)
        return merged

    def shutdown(self) -> None:
        try:
            if issubclass(self.worker_cls, RLWorker):
                self.close_weight_group()
            self.call_all(RLWorker.shutdown)
        finally:
            if self.use_ray:
                import ray

                for worker in self.workers:
                    ray.kill(worker)
