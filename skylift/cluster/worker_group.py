"""Training workers of a run: FSDP2 ranks as Ray actors (or one in-process rank), plus weight sync.

`RLWorker` adds to `TrainingWorker` the one RL-specific duty of the policy: pushing its weights
to the inference engines. `WorkerGroup` starts the ranks, shards batches over them and calls
them in lockstep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from skylift.algorithms.sample_support import Sampling
from skylift.cluster.engines import EngineRef
from skylift.cluster.placement import PlacedGroups
from skylift.utils.calls import run_on_loop
from skylift.weight_sync.buckets import str_to_dtype
from skylift.worker.batch import SequenceBatch
from skylift.worker.training_worker import LossFn, TrainingWorker, WorkerSettings

# Bucket size of the policy's weight syncs. Each engine's worker keeps two buckets' worth of
# receive memory between syncs (`BufferArena`; the sender's arenas hold only the small tensors it
# coalesces), so a smaller bucket keeps less resident, with the same sync time, since the stream
# loads bucket k while bucket k+1 travels (the demo's figures: benchmarks/RESULTS.md).
SYNC_BUCKET_MB = 64

logger = logging.getLogger("skylift.cluster.worker_group")


class RLWorker(TrainingWorker):
    """A training rank that can also broadcast its weights to inference engines (rank 0 sends)."""

    def __init__(
        self,
        *args: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        node_ip: str | None = None,
        **kwargs: Any,
    ) -> None:
        """`loop`: the event loop in-process engines live on (placement backend "local");
        `node_ip`: the IP of the node this rank runs on (None: Ray's, or 127.0.0.1 without Ray)."""
        super().__init__(*args, **kwargs)
        self._loop = loop
        self._node_ip = node_ip
        self._sender: Any = None
        self._lora: Any = None  # the LoRA adapter versions on the engines (LoraPublisher)
        self._engines: list[Any] = []

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return run_on_loop(self._loop, coro)

    def node_ip(self) -> str:
        """The address of this rank's node as the cluster knows it (127.0.0.1 without Ray)."""
        if self._node_ip is None:
            import ray

            self._node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return self._node_ip

    def init_weight_sync(
        self,
        engine_refs: Sequence[EngineRef],
        override_existing: bool,
        backend: str | None = None,
        timeout_s: float = 120.0,
        master_address: str | None = None,
    ) -> str | None:
        """Create the weight-update group (rank 0 only); returns the address its store listens on.

        `master_address`: `generator.weight_sync_master_address`; None = this node's IP for local
        engines, or this host's address on the route to the first remote engine.
        """
        if self.rank != 0:
            return None
        from skylift.weight_sync import WeightSender
        from skylift.weight_sync.sender import weight_sync_master_address

        address = weight_sync_master_address(
            master_address, [ref.url for ref in engine_refs if ref.url], self.node_ip()
        )
        self._engines = [ref.connect() for ref in engine_refs]
        self._sender = WeightSender(timeout_s=timeout_s, update_timeout_s=timeout_s)
        self._run(
            self._sender.init_group(
                self._engines, master_address=address, backend=backend, override_existing=override_existing
            )
        )
        return address

    def sync_weights(
        self, bucket_mb: int = SYNC_BUCKET_MB, dtype: str | None = None, lora_sync_path: str | None = None
    ) -> dict[str, float]:
        """Broadcast the full weights to every engine (all ranks call: gathering is collective).

        `dtype`: the engines' weight dtype (e.g. "bfloat16" engines of a float32 policy); floating
        tensors are cast to it before sending, so half the bytes travel. None sends them as they are.
        A LoRA policy sends only its adapter (`sync_lora_adapter`).
        """
        if self.settings.lora_rank > 0:
            return self.sync_lora_adapter(dtype, lora_sync_path)
        started = time.perf_counter()
        weights = self.iter_full_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return {}
        if dtype is not None:  # only the sending rank pays for the cast
            weights = _cast_floating(weights, str_to_dtype(dtype))
        if self._sender is None:
            raise RuntimeError("init_weight_sync() was not called before sync_weights()")
        self._run(self._sender.send_state_dict(weights, bucket_bytes=bucket_mb << 20))
        return {"timing/weight_sync_s": time.perf_counter() - started}

    def sync_lora_adapter(self, dtype: str | None = None, sync_path: str | None = None) -> dict[str, float]:
        """Send only the LoRA adapter; the engines load it as their default adapter under a new
        name (`skylift.weight_sync.lora`): over the weight-update group, or through `sync_path`
        (`generator.lora_sync_path`) when set. All ranks call (gathering is collective)."""
        from skylift.weight_sync.lora import LoraPublisher, cast_floating

        started = time.perf_counter()
        tensors, peft_config = self.lora_adapter()
        if self.rank != 0:
            return {}
        if self._sender is None:
            raise RuntimeError("init_weight_sync() was not called before sync_weights()")
        if self._lora is None:
            self._lora = LoraPublisher()
        stats = self._run(
            self._lora.publish(
                self._engines,
                cast_floating(tensors, str_to_dtype(dtype) if dtype else None),
                peft_config,
                group=self._sender.group,
                sync_path=sync_path,
                timeout_s=self._sender.update_timeout_s,
            )
        )
        return {
            "timing/weight_sync_s": time.perf_counter() - started,
            "weight_sync/bytes": float(stats.bytes),
        }

    def rebuild_weight_sync(
        self,
        engine_refs: Sequence[EngineRef],
        backend: str | None = None,
        timeout_s: float = 120.0,
        master_address: str | None = None,
    ) -> None:
        """A new group with `engine_refs` only (after engines failed): the old group is destroyed
        (failures of dead engines to answer are expected and logged) and the live engines replace
        their membership (`override_existing`)."""
        if self.rank != 0:
            return
        self.close_weight_sync()
        self.init_weight_sync(
            engine_refs,
            override_existing=True,
            backend=backend,
            timeout_s=timeout_s,
            master_address=master_address,
        )

    def close_weight_sync(self) -> None:
        """Destroy the group; engines that cannot be reached any more are logged, not raised."""
        if self._sender is not None:
            from skylift.weight_sync import WeightSyncError

            try:
                self._run(self._sender.close())
            except WeightSyncError as exc:
                logger.warning("closing the weight-update group: %s", exc)
            finally:
                self._sender = None


def _cast_floating(weights: Iterator[tuple[str, Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in weights:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


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


def _file_rendezvous(name: str) -> str:
    return "file://" + os.path.join(tempfile.mkdtemp(prefix=f"skylift-{name}-"), "rendezvous")


def _free_port_on_node() -> tuple[str, int]:
    """(node IP, a TCP port free on it a moment ago), run on the node that will host rank 0."""
    import socket

    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return ip, int(sock.getsockname()[1])


def _rendezvous(name: str, placement: PlacedGroups, role: str, node_ips: Sequence[str]) -> str:
    """file:// when every rank is on the driver's node, else tcp://<rank 0's node IP>:<free port>."""
    import ray

    from skylift.worker.distributed import tcp_init_method

    here = ray.util.get_node_ip_address()
    if all(ip == here for ip in node_ips):
        return _file_rendezvous(name)
    options = placement.options(role, 0)
    options.update(num_cpus=0, num_gpus=0)
    options.pop("resources", None)
    probe = ray.remote(_free_port_on_node).options(**options).remote()
    ip, port = ray.get(probe, timeout=60)
    logger.info("%s: %d ranks on %s meet at %s:%d", name, len(node_ips), sorted(set(node_ips)), ip, port)
    return tcp_init_method(ip, port)


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
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = 3600.0,
        placement: PlacedGroups | None = None,
        role: str | None = None,
    ) -> None:
        """`timeout_s`: the longest one call to the Ray workers may take (in-process calls cannot
        be interrupted; their collectives have the process group's own timeout).

        `placement`: the run's placement groups; rank r goes on the bundle of (`role`, r) (role
        defaults to `name`). The ranks meet over a file on one host, or over TCP at rank 0's node
        IP (MASTER_ADDR) when any rank runs on another node.
        """
        self.name = name
        self.world_size = world_size
        self.use_ray = use_ray
        self.timeout_s = timeout_s
        self.node_ips: list[str] = []
        if use_ray:
            import ray

            cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(RLWorker)
            if placement is not None:
                role = role or name
                self.node_ips = [placement.node_ip(role, r) for r in range(world_size)]
                init_method = _rendezvous(name, placement, role, self.node_ips)
                self.workers: list[Any] = [
                    cls.options(**placement.options(role, rank)).remote(
                        settings, rank, world_size, init_method, node_ip=self.node_ips[rank]
                    )
                    for rank in range(world_size)
                ]
            else:
                init_method = _file_rendezvous(name)
                self.workers = [
                    cls.remote(settings, rank, world_size, init_method) for rank in range(world_size)
                ]
        else:
            init_method = _file_rendezvous(name)
            if world_size != 1:
                raise ValueError(f"{name}: more than one worker needs Ray (world_size={world_size})")
            self.workers = [RLWorker(settings, 0, 1, init_method, loop=loop)]

    def _call(
        self, method: str, per_rank_args: Sequence[tuple] | None = None, *args: Any, **kwargs: Any
    ) -> list[Any]:
        if self.use_ray:
            refs = [
                getattr(w, method).remote(*(per_rank_args[r] if per_rank_args else args), **kwargs)
                for r, w in enumerate(self.workers)
            ]
            return wait_for_ranks(refs, f"{self.name} worker", method, self.timeout_s)
        return [getattr(self.workers[0], method)(*(per_rank_args[0] if per_rank_args else args), **kwargs)]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._call(method, None, *args, **kwargs)

    def shards(self, batch: SequenceBatch) -> list[SequenceBatch]:
        """Rows of `batch` split into `world_size` contiguous, near-equal shards."""
        n = batch.batch_size
        bounds = [round(r * n / self.world_size) for r in range(self.world_size + 1)]
        return [batch.select(list(range(bounds[r], bounds[r + 1]))) for r in range(self.world_size)]

    def setup(self) -> list[dict[str, Any]]:
        return self.call_all("setup")

    # ---- the policy's weight-update group (rank 0 sends; every rank gathers)
    def init_weight_sync(
        self,
        engine_refs: Sequence[EngineRef],
        override_existing: bool,
        backend: str | None,
        timeout_s: float,
        master_address: str | None,
    ) -> str:
        """The group rank 0 -> `engine_refs`; the address its store listens on."""
        return self.call_all(
            "init_weight_sync", engine_refs, override_existing, backend, timeout_s, master_address
        )[0]

    def sync_weights(self, dtype: str | None, lora_sync_path: str | None) -> None:
        """Broadcast the weights (a LoRA policy: its adapter) to the group's engines."""
        self.call_all("sync_weights", dtype=dtype, lora_sync_path=lora_sync_path)

    def rebuild_weight_sync(
        self,
        engine_refs: Sequence[EngineRef],
        backend: str | None,
        timeout_s: float,
        master_address: str | None,
    ) -> None:
        """A new group of `engine_refs` only (after engines failed)."""
        self.call_all("rebuild_weight_sync", engine_refs, backend, timeout_s, master_address)

    def close_weight_sync(self) -> None:
        self.call_all("close_weight_sync")

    # ---- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its shard of the model and optimizer state under `path`."""
        self.call_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.call_all("load_checkpoint", path)

    def export_hf(self, path: str) -> str:
        """The model as a Hugging Face directory at `path` (LoRA merged); returns the path."""
        return str(self.call_all("export_hf", path)[0])

    def compute_logprobs(self, batch: SequenceBatch, micro_batch_size: int, temperature: Sampling) -> Any:
        return self._per_token("compute_logprobs", batch, micro_batch_size, temperature)

    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> Any:
        return self._per_token("compute_values", batch, micro_batch_size)

    def _per_token(self, method: str, batch: SequenceBatch, *args: Any) -> Any:
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
            "train_mini_batch", [(s, loss_fn, micro_batch_size, temperature) for s in shards]
        )
        merged: dict[str, float] = {}
        for key in results[0]:
            merged[key] = sum(r[key] for r in results) / len(results)
        return merged

    def shutdown(self) -> None:
        try:
            self.close_weight_sync()
            self.call_all("shutdown")
        finally:
            if self.use_ray:
                import ray

                for worker in self.workers:
                    ray.kill(worker)
