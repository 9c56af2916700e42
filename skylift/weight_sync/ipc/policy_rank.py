"""The policy's side of the IPC transport in a training run: rank 0 shares the full weights by
handle with the engines on its host (CUDA IPC on a GPU, /dev/shm on CPU).

`SharedWeightsRank` is mixed into the policy's training worker (`cluster.worker_group.RLWorker`),
which gives it `rank`, `device` and `engine_weights()` (every rank gathers the full weights, a
collective, as the broadcast path does with FSDP2; rank 0 alone gets them). The driver
(`ipc.policy_transport.PolicySharedTransport`) calls these methods on rank 0 or on every rank and
tells the engines to load meanwhile; no rank calls an engine.

Two ways a push goes, as `SharedWeightsSender` keeps them:
- fresh buffers (every push on a GPU, and a first push whose layout is not known before
  gathering): the weights are gathered whole, copied into new shared buffers, the engines load
  them, the driver releases them (`release_shared_weights`);
- kept buffers (CPU; `keep_buffers`): buffers laid out from the weights' names, shapes and dtypes
  (`engine_weight_layout`, meta tensors: nothing gathered) stay mapped on both sides, and each
  push, the first included, is copied into them tensor by tensor as the gather yields them, a
  shared counter telling the engines' workers how many buckets are in: they load bucket k while
  bucket k+1 is copied (`ipc.receiver`). Rank 0 holds one copy of the weights in shared memory
  and one gathered tensor at a time (gathering the whole state first held a second full copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from skylift.weight_sync.buckets import NamedTensor, iter_buckets, str_to_dtype
from skylift.weight_sync.ipc.handles import (
    SharedTensors,
    handle_to_wire,
    new_shared,
    open_shared,
    share_tensors,
    tensor_slots,
)
from skylift.weight_sync.ipc.place import place_of
from skylift.weight_sync.ipc.shm_segments import free_bytes
from skylift.weight_sync.process_group import WeightSyncError


def _cast(weights: Iterator[NamedTensor], dtype: torch.dtype | None) -> Iterator[NamedTensor]:
    for name, t in weights:
        yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t


class SharedWeightsSender:
    """Rank 0's shared buffers: the kept ones (CPU), the fresh ones of a push in flight, and the
    fill counter the engines' workers read."""

    def __init__(self) -> None:
        self.kept: SharedTensors | None = None
        self.fresh: SharedTensors | None = None
        self._ready: tuple[SharedTensors, torch.Tensor] | None = None

    def _counter(self) -> tuple[SharedTensors, torch.Tensor]:
        if self._ready is None:
            ready = share_tensors({"ready": torch.zeros(1, dtype=torch.int64)})
            self._ready = ready, open_shared(ready)["ready"]
        return self._ready

    def plan(self, bucket_bytes: int) -> dict[str, Any] | None:
        """The payload of a streamed push into the kept buffers ({"handle", "ready", "buckets"},
        the counter reset to 0), or None when there are none."""
        if self.kept is None:
            return None
        slots = tensor_slots(self.kept)
        meta = [
            (name, torch.empty(slots[name][1].shape, dtype=slots[name][0].dtype, device="meta"))
            for name in self.kept.order
        ]
        buckets = [[n for n, _ in b] for b in iter_buckets(meta, bucket_bytes)]
        ready, counter = self._counter()
        counter[0] = 0
        return {"handle": handle_to_wire(self.kept), "ready": handle_to_wire(ready), "buckets": buckets}

    def allocate(self, layout: list[NamedTensor]) -> None:
        """Kept buffers (host memory) for weights of `layout` (meta tensors), nothing written yet."""
        self.drop_kept()
        self.kept = new_shared(layout, torch.device("cpu"))

    def fill(self, weights: Iterator[NamedTensor], buckets: list[list[str]]) -> int:
        """Copy `weights` (in the kept buffers' order and layout) into the kept buffers, raising the
        counter after each of `buckets`; returns the bytes copied. Anything else (another layout)
        sets the counter to -1 (the workers stop), drains `weights` (the other ranks' gathers
        complete) and raises."""
        handle = self.kept
        if handle is None:
            raise WeightSyncError("shared-memory weight sync: no kept buffers to fill")
        _, counter = self._counter()
        slots = tensor_slots(handle)
        ends = {b[-1]: k + 1 for k, b in enumerate(buckets) if b}
        order, i, nbytes = handle.order, 0, 0
        try:
            with torch.no_grad():
                for name, t in weights:
                    flat, spec = slots.get(name, (None, None))
                    if i >= len(order) or name != order[i] or spec is None or tuple(t.shape) != spec.shape:
                        raise WeightSyncError(
                            f"shared-memory weight sync: tensor {name!r} {tuple(t.shape)} does not fit the "
                            f"kept buffers (expected {order[i] if i < len(order) else 'no more tensors'})"
                        )
                    flat[spec.offset : spec.offset + spec.numel].copy_(t.detach().reshape(-1))
                    nbytes += spec.numel * flat.element_size()
                    i += 1
                    if name in ends:
                        counter[0] = ends[name]  # the workers may load this bucket now
            if i != len(order):
                raise WeightSyncError(f"shared-memory weight sync: {len(order) - i} tensor(s) never came")
        except BaseException:
            counter[0] = -1
            for _ in weights:
                pass
            raise
        return nbytes

    def share(self, weights: Iterator[NamedTensor], keep: bool) -> SharedTensors:
        """The weights copied into new shared buffers; kept for the next push when `keep` and
        they are all in host memory, else held until `release_fresh`."""
        self.release_fresh()
        handle = share_tensors(dict(weights))
        if keep and all(b.device == "cpu" for b in handle.buffers):
            self.drop_kept()
            self.kept = handle
        else:
            self.fresh = handle
        return handle

    def release_fresh(self) -> None:
        if self.fresh is not None:
            self.fresh.release()
            self.fresh = None

    def drop_kept(self) -> None:
        if self.kept is not None:
            self.kept.release()
            self.kept = None

    def close(self) -> None:
        self.release_fresh()
        self.drop_kept()
        if self._ready is not None:
            self._ready[0].release()
            self._ready = None


class SharedWeightsRank:
    """Mixed into the policy's worker: `rank`, `device` and `engine_weights()` are the worker's."""

    rank: int
    device: torch.device
    engine_weights: Any  # the worker's: () -> Iterator[NamedTensor], a collective

    def _shared_sender(self) -> SharedWeightsSender:
        sender = self.__dict__.get("_skylift_shared_sender")
        if sender is None:
            sender = self.__dict__["_skylift_shared_sender"] = SharedWeightsSender()
        return sender  # type: ignore[no-any-return]

    def weight_sync_place(self) -> dict[str, Any]:
        """Where this rank's tensors live (`ipc.place.place_of`)."""
        return place_of(getattr(self, "device", None))

    def shared_memory_room(self, dtype: str | None = None) -> dict[str, int | None]:
        """Rank 0 on CPU: {"need": bytes of the engines' weights in `dtype` (None: not known before
        gathering), "free": bytes free in /dev/shm (None: not usable)}, for `auto`'s choice of
        shared memory over gloo (`weight_sync.placed`)."""
        layout = self.engine_weight_layout()
        cast = str_to_dtype(dtype) if dtype else None
        need = (
            None
            if layout is None
            else sum(t.numel() * t.element_size() for _, t in _cast(iter(layout), cast))
        )
        try:
            free: int | None = free_bytes()
        except OSError:
            free = None
        return {"need": need, "free": free}

    def engine_weight_layout(self) -> list[NamedTensor] | None:
        """What `engine_weights` yields, as meta tensors (None: not known before gathering; the
        worker's, `cluster.worker_group.RLWorker`)."""
        return None

    def shared_weights_plan(
        self, bucket_bytes: int, dtype: str | None = None, allocate: bool = False
    ) -> dict[str, Any] | None:
        """Rank 0: the payload of a streamed push into the kept buffers, or None (none kept).
        `allocate`: with none kept and the weights in host memory, lay kept buffers out from
        `engine_weight_layout` (cast to `dtype`) first, so the first push streams too."""
        if self.rank != 0:
            return None
        sender = self._shared_sender()
        if sender.kept is None and allocate and torch.device(getattr(self, "device", "cpu")).type == "cpu":
            layout = self.engine_weight_layout()
            if layout is not None:
                sender.allocate(list(_cast(iter(layout), str_to_dtype(dtype) if dtype else None)))
        return sender.plan(bucket_bytes)

    def share_weights(self, dtype: str | None = None, keep: bool = False) -> dict[str, Any] | None:
        """Gather the full weights (every rank) and copy them into new shared buffers (rank 0):
        {"handle": wire form, "kept": whether they stay for the next push, "bytes"}."""
        weights = self.engine_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return None
        handle = self._shared_sender().share(_cast(weights, str_to_dtype(dtype) if dtype else None), keep)
        kept = handle is self._shared_sender().kept
        return {"handle": handle_to_wire(handle), "kept": kept, "bytes": handle.nbytes}

    def fill_shared_weights(self, buckets: list[list[str]], dtype: str | None = None) -> int:
        """Gather the full weights (every rank) and copy them into the kept buffers as they come
        (rank 0), raising the fill counter bucket by bucket; the bytes copied (0 elsewhere)."""
        weights = self.engine_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return 0
        return self._shared_sender().fill(_cast(weights, str_to_dtype(dtype) if dtype else None), buckets)

    def release_shared_weights(self, kept: bool = False) -> None:
        """Rank 0: free the fresh buffers of the last push (the engines loaded them); `kept`: the
        kept ones too."""
        sender = self.__dict__.get("_skylift_shared_sender")
        if sender is not None:
            sender.release_fresh()
            if kept:
                sender.close()
