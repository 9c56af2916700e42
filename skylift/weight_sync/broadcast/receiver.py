"""The weight-update receiver that vLLM mixes into every one of its workers.

vLLM gets it as ``worker_extension_cls="skylift.inference.vllm_worker.WeightSyncWorkerExtension"``
(engine args or ``--worker-extension-cls``; that module also installs skylift's vLLM fixes); the
methods below are then callable on every worker through ``collective_rpc`` under the names of
`skylift.weight_sync.protocol` (``RPC_*``). Their names carry a ``skylift_`` prefix because vLLM
refuses an extension whose method names clash with its Worker's (``update_weights``...).

Each worker joins the trainer's weight-update group as rank ``rank_offset + worker rank``,
receives a bucket's flat buffers by broadcast from rank 0 (wire format: `WeightBucket`) and loads
them in place with vLLM's ``reload_weights`` using Hugging Face parameter names.

A bucket must hold every Hugging Face tensor that vLLM fuses into one module (``q_proj``,
``k_proj``, ``v_proj`` weights and biases -> ``qkv_proj``; ``gate_proj`` + ``up_proj`` ->
``gate_up_proj``): vLLM rebuilds a module from the tensors of one reload and leaves the parts it
did not receive uninitialised. A bucket that covers such a module partially is received (so the
sender's broadcast completes) and then refused with an error naming the missing parts. Groups
made with the per-tensor protocol (one tensor per update) stage such parts instead (`fused_staging`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from skylift.weight_sync.broadcast.direct_load import DirectLoader, load_direct_then_reload
from skylift.weight_sync.broadcast.fused_staging import FusedStager, IncompleteModuleError, LoadUnits
from skylift.weight_sync.broadcast.stream import STREAM_DEPTH, BucketStream
from skylift.weight_sync.buckets import (
    BufferArena,
    NamedTensor,
    Piece,
    unpack_bucket,
)
from skylift.weight_sync.process_group import (
    WeightSyncError,
    WeightSyncGroup,
    create_weight_sync_group,
    receive_bucket,
)
from skylift.weight_sync.protocol import PER_TENSOR

logger = logging.getLogger(__name__)

#: vLLM loggers that warn, on every bucket, about the weights a bucket does not carry (the others
#: keep their current values, which is what a bucketed update wants).
_PARTIAL_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


@contextlib.contextmanager
def _partial_reload_quietly() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class WeightSyncWorkerExtension:
    """Receiver side of skylift's weight sync; a mixin for vLLM's Worker (uses its attributes
    ``rank``, ``device``, ``vllm_config`` and ``model_runner``)."""

    _skylift_group: WeightSyncGroup | None = None
    _skylift_units: LoadUnits | None = None
    #: set for groups whose sender sends one tensor per update (the per-tensor protocol)
    _skylift_stager: FusedStager | None = None
    _skylift_arenas: list[BufferArena] | None = None
    #: the stream loads buckets with `direct_load` where it can (False: always vLLM's reload)
    _skylift_direct_load: bool = True
    _skylift_direct: DirectLoader | bool | None = None  # False: this model is not supported

    def _skylift_worker_rank(self) -> int:
        rank: Any = getattr(self, "rank", 0)
        return int(rank)

    def _skylift_load_units(self) -> LoadUnits:
        """Which Hugging Face tensors vLLM loads together into one module."""
        if self._skylift_units is None:
            self._skylift_units = LoadUnits.from_model(self.model_runner.get_model())  # type: ignore[attr-defined]
        return self._skylift_units

    def _skylift_check_whole_units(self, names: list[str]) -> None:
        """Raise when `names` cover a vLLM module only in part (see the module docstring)."""
        for module, (sent, missing) in self._skylift_load_units().partial_units(names).items():
            raise WeightSyncError(
                f"bucket holds {len(sent)} of the {len(sent) + len(missing)} tensors that vLLM loads "
                f"together into {module} (got {sent}); a partial load would leave the rest uninitialised, "
                "so nothing was loaded: send all parts of a fused module (e.g. q/k/v weights and biases) "
                "in one bucket"
            )

    def skylift_init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        override_existing: bool,
        timeout_s: float,
        protocol: str = "skylift",
    ) -> None:
        """Join the trainer's group as rank ``rank_offset + worker rank`` (blocks until all joined).

        An existing group is an error unless `override_existing`, which destroys it first.
        `protocol` `PER_TENSOR`: the trainer built its side with torch's group helper (see
        `torch_group`) and sends one tensor per update, so the
        parts of fused modules are staged until complete (`fused_staging`).
        """
        rank = rank_offset + self._skylift_worker_rank()
        if self._skylift_group is not None:
            if not override_existing:
                old = self._skylift_group
                raise WeightSyncError(
                    f"a weight-update group already exists on this worker ({old.group_name!r}, rank "
                    f"{old.rank}/{old.world_size}); destroy it first or pass override_existing=True"
                )
            self.skylift_destroy_weight_update_group()
        device = torch.device(getattr(self, "device", None) or "cpu") if backend == "nccl" else None
        per_tensor = protocol == PER_TENSOR  # its trainer builds the group with torch's own helper
        self._skylift_group = create_weight_sync_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            device=device,
            layout="torch" if per_tensor else "skylift",
        )
        if per_tensor:
            self._skylift_stager = FusedStager(self._skylift_load_units())
        logger.info(
            "joined %sweight-update group %r as rank %d/%d",
            "per-tensor " if per_tensor else "",
            group_name,
            rank,
            world_size,
        )

    def skylift_receive_weights(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> str | None:
        """Receive one bucket from rank 0 (one flat broadcast per dtype) and load it in place.

        Returns None, or (staging groups only) why nothing was loaded: a fused module left
        incomplete when the sender moved past its layer."""
        start = time.perf_counter()
        bucket, buffers = receive_bucket(self._skylift_group, names, dtypes, shapes)
        received = time.perf_counter()
        weights = unpack_bucket(bucket, buffers)
        if self._skylift_stager is not None:
            try:
                weights = self._skylift_stager.add(weights)
            except IncompleteModuleError as exc:
                return str(exc)
            if not weights:
                return None
        else:
            self._skylift_check_whole_units(bucket.names)
        self._skylift_reload(weights)
        logger.debug(
            "received %d tensors in %.1f ms, loaded in %.1f ms",
            len(names),
            1e3 * (received - start),
            1e3 * (time.perf_counter() - received),
        )
        return None

    def _skylift_direct_loader(self) -> DirectLoader | None:
        """The loader that bypasses vLLM's generic reload for this model (None: not supported)."""
        if not self._skylift_direct_load:
            return None
        if self._skylift_direct is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            loader = DirectLoader.for_model(model, self.vllm_config, self._skylift_load_units())  # type: ignore[attr-defined]
            self._skylift_direct = loader if loader is not None else False
        return self._skylift_direct or None

    @contextlib.contextmanager
    def _skylift_loading(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            yield

    def _skylift_reset_runner_caches(self) -> None:
        """What vLLM's `reload_weights` resets after loading (LoRA state, encoder and multimodal caches)."""
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            method = getattr(self.model_runner, reset, None)  # type: ignore[attr-defined]
            if callable(method):
                method()

    def _skylift_reload(self, weights: Iterable[NamedTensor]) -> None:
        """vLLM's in-place reload of `weights` (Hugging Face names), pulled as it goes."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad(), _partial_reload_quietly():  # type: ignore[attr-defined]
            self.model_runner.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]

    def skylift_receive_weight_stream(self) -> dict[str, Any]:
        """Receive every bucket of one sync (`weight_sync.broadcast.stream`) and load them in ONE reload
        that runs while the next bucket arrives.

        Returns ``{"buckets", "tensors", "bytes", "receive_s", "seconds", "refused",
        "direct_buckets"}``; `refused` (None or why) is set when a bucket covered a fused module
        only in part: that bucket and the ones after it are received (so rank 0's broadcasts
        complete) and not loaded; the buckets before it are loaded, as with
        `skylift_receive_weights` bucket by bucket. Buckets go straight into the model's modules
        (`direct_load`; `direct_buckets` of them) while every tensor is one that path maps; from
        the first bucket it does not, the rest of the stream is one vLLM reload."""
        group = self._skylift_group
        if group is None:
            raise WeightSyncError(
                "no weight-update group on this worker: call init_weight_update_communicator first"
            )
        if self._skylift_stager is not None:
            raise WeightSyncError(
                f"group {group.group_name!r} was made with the per-tensor protocol (one tensor per update); "
                "a weight stream needs skylift's"
            )
        start = time.perf_counter()
        if not self._skylift_arenas:  # receive memory kept from sync to sync, dropped with the group
            self._skylift_arenas = [BufferArena(group.device) for _ in range(STREAM_DEPTH)]
        stream = BucketStream(group, self._skylift_arenas)
        refused: str | None = None

        def pieces() -> Iterator[Piece]:
            """The stream's buckets up to the first that covers a fused module in part."""
            nonlocal refused
            for bucket, buffers in stream:  # a bucket's arena is freed when the next is asked for
                try:
                    self._skylift_check_whole_units(bucket.names)
                except WeightSyncError as exc:
                    refused = str(exc)
                    return
                yield bucket, unpack_bucket(bucket, buffers)

        try:
            loaded_directly, _reloaded = load_direct_then_reload(self, pieces())
        finally:
            stream.drain()  # the rest of a refused stream; raises when receiving failed
        seconds = time.perf_counter() - start
        logger.debug(
            "weight stream: %d buckets, %d tensors in %.1f ms (%.1f ms receiving)",
            stream.stats.buckets,
            stream.stats.tensors,
            1e3 * seconds,
            1e3 * stream.receive_s,
        )
        return {
            "buckets": stream.stats.buckets,
            "tensors": stream.stats.tensors,
            "bytes": stream.stats.bytes,
            "receive_s": stream.receive_s,
            "seconds": seconds,
            "refused": refused,
            "direct_buckets": loaded_directly,
        }

    def skylift_destroy_weight_update_group(self) -> str | None:
        """Leave and destroy the weight-update group (a no-op when there is none). Returns what
        was staged and never completed (nothing of it was loaded), or None."""
        group, self._skylift_group = self._skylift_group, None
        stager, self._skylift_stager = self._skylift_stager, None
        self._skylift_arenas = None
        if group is not None:
            group.destroy()
        return stager.pending() if stager is not None else None

    def skylift_has_weight_update_group(self) -> bool:
        """True while this worker is in a weight-update group."""
        return self._skylift_group is not None
