"""`WeightTransport`: how a new policy version reaches the engines, whatever carries it.

A transport is opened for the pool's engines, pushes versions, and is closed. `stage` is the work
that may overlap generation (a delta version published and fetched by every engine host); `push`
is the moment the engines' weights change, which the caller wraps in a pause when requests are in
flight (`skylift.cluster.engine_weights.EngineWeights`: wake, pause, resume and the version the
engines hold are its, not a transport's). `make_transport` (`weight_sync.factory`) picks one from
the config: `BroadcastTransport` (full weights over a weight-update group,
`weight_sync.broadcast`), `LoraTransport` (a LoRA adapter, over the group or through a
directory, `weight_sync.lora`) or `DeltaTransport` (changed tensors through a shared directory or
bucket, `weight_sync.delta`). Each transport's folder holds its halves: the trainer's side, the
engine's (`weight_sync.engine_side.EngineSide`, reached through `weight_call`) and the workers';
what two of them share (the wire
protocol, the group, the buckets, the engines' group client `control`, the driver's end of the
group `policy_sync`) stays at `weight_sync`'s top.

Where the weights come from is each transport's: the three above pull a version from the policy
(its ranks broadcast or publish it when pushed). `TensorsTransport` (`broadcast.tensors`) and
`SharedTensorsTransport` (`ipc.transport`; the Tinker sampler's on one host) have no policy behind them: its source is a set of tensors in this process, which
the caller hands over with `put(tensors)` before each `push(version)` (a push with nothing put
is an error, as a delta push with nothing staged is).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class EngineSet(Protocol):
    """The engines a transport serves (`skylift.inference.pool.EnginePool`): which are alive, and
    the calls that reach every live one (engines that fail are taken out by the set)."""

    engines: Sequence[Any]

    @property
    def live_indices(self) -> list[int]: ...
    async def probe(self, timeout_s: float = 10.0) -> list[int]: ...
    async def weight_call(
        self, transport: str, operation: str, payload: dict[str, Any] | None = None, *, strict: bool = True
    ) -> list[Any]:
        """One operation of `transport`'s engine half on every live engine (`engine_side`);
        `strict=False`: an engine that fails is taken out and the others go on."""
        ...


Say = Callable[[str], None]


class WeightTransport(ABC):
    """Open for a set of engines, push a version, close."""

    #: whether the caller resets the engines' prefix caches after a push made while they were
    #: paused with requests in flight (full weights: every cached block is stale; a LoRA adapter
    #: comes under a new name, so base-model blocks stay valid; a delta load resets it itself)
    needs_prefix_reset: bool = True

    #: what carries the weights, in the run's metrics (`weight_sync/via/<name>`): "ipc", "gloo",
    #: "nccl", "lora", "delta", "ipc+nccl" (a mix), ... (a transport that learns it at `open`
    #: overrides the property)
    kind: str = "broadcast"

    @property
    def name(self) -> str:
        return self.kind

    @abstractmethod
    async def open(self) -> str:
        """Set up for the set's live engines; one line for the run's log saying how."""

    async def stage(self, version: int) -> None:  # noqa: B027 - most transports stage nothing
        """Work for `version` that may run while the engines still generate."""

    @abstractmethod
    async def push(self, version: int) -> dict[str, float]:
        """The live engines' weights become `version` (staged first); the push's metrics."""

    @abstractmethod
    async def close(self) -> None:
        """Undo `open` (engines that cannot be reached any more are logged, not raised)."""
