"""The broadcast transport's engine half: the weight-update group and full weights over it.

Operations (``weight_call("broadcast", operation, payload)``; payloads and answers JSON-ready):

- ``join`` (a `WeightUpdateGroupSpec`): every worker joins the trainer's group, concurrently with
  the trainer's rendezvous, once a store answers at its address (`broadcast.rendezvous`: an address
  where none does is an `EngineRequestError` after `timeout_s`, the engine untouched). An existing
  group is an `EngineStateError` unless `override_existing`. The LoRA transport's in-memory
  adapters travel over this same group.
- ``bucket`` (a `WeightBucket`): receive one bucket (the sender broadcasts concurrently), load it
  in place, reset the prefix cache; answers {num_tensors, weight_version, prefix_cache_reset,
  seconds}. Bad metadata is an `EngineRequestError`, no group an `EngineStateError`.
- ``stream`` ({}): every bucket of one sync in ONE call to the workers (`broadcast.stream`: the
  reload of a bucket overlaps the broadcast of the next), then reset the prefix cache. The engine
  core runs no model step during the call, so no request sees a half-updated model. Answers what
  arrived (buckets, tensors, bytes, seconds, worker_seconds, direct_buckets, weight_version,
  prefix_cache_reset); a refused bucket is an `EngineStateError` (see the receiver).
- ``leave`` ({}): leave and destroy the group on every worker (no-op when none).
- ``has_group`` ({}): whether every worker is in a group (while a weight call runs: whether the
  last one left a group).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from skylift.utils.engine_errors import EngineRequestError, EngineStateError
from skylift.weight_sync.broadcast.rendezvous import join_weight_update_group
from skylift.weight_sync.buckets import validate_bucket
from skylift.weight_sync.engine_side import EngineHost, EngineSide, Payload, WeightState, decode
from skylift.weight_sync.protocol import (
    RPC_DESTROY,
    RPC_HAS_GROUP,
    RPC_INIT_GROUP,
    RPC_RECEIVE,
    RPC_RECEIVE_STREAM,
    WeightBucket,
    WeightUpdateGroupSpec,
)

logger = logging.getLogger(__name__)


def require_group(host: EngineHost, state: WeightState, operation: str) -> None:
    """An `EngineStateError` when the engine's workers are in no weight-update group."""
    if state.group_name is None:
        raise EngineStateError(
            f"{host.name}: {operation}: no weight-update group: call init_weight_update_communicator first"
        )


class BroadcastEngineSide(EngineSide):
    transport = "broadcast"

    def __init__(self, host: EngineHost, state: WeightState) -> None:
        super().__init__(host, state)
        self.operations = {
            "join": self.join,
            "bucket": self.bucket,
            "stream": self.stream,
            "leave": self.leave,
            "has_group": self.has_group,
        }

    async def join(self, payload: Payload) -> None:
        spec: WeightUpdateGroupSpec = decode(
            self.host, "init_weight_update_communicator", WeightUpdateGroupSpec, payload
        )
        tp = self.host.workers
        last = spec.rank_offset + tp - 1
        if last >= spec.world_size:
            raise EngineRequestError(
                f"{self.host.name}: world_size={spec.world_size} is too small: this engine's {tp} "
                f"worker(s) take ranks {spec.rank_offset}..{last}"
            )
        async with self.state.lock:
            if self.state.group_name is not None and not spec.override_existing:
                raise EngineStateError(
                    f"{self.host.name}: a weight-update group ({self.state.group_name!r}) already exists; "
                    "pass override_existing=True to replace it"
                )
            self.state.group_name = None
            await join_weight_update_group(self.host.rpc, spec, RPC_INIT_GROUP, ranks=tp)
            self.state.group_name = spec.group_name

    async def _receive(
        self,
        operation: str,
        rpc: tuple[str, str, tuple],
        refusal_of: Callable[[Any], str | None],
        loads_of: Callable[[list[Any]], int],
    ) -> tuple[list[Any], float, bool]:
        """One receiving call to every worker (`rpc`: its label, method and args), with the group
        checked first, a worker's refusal (`refusal_of` its result) an `EngineStateError`, the
        weight version advanced by `loads_of(results)` and the prefix cache reset after it.
        Returns the workers' results, the seconds they took and whether the cache was reset."""
        async with self.state.lock:
            require_group(self.host, self.state, operation)
            start = time.perf_counter()
            results = await self.host.rpc(*rpc, self.host.update_timeout_s)
            refusal = next((r for r in map(refusal_of, results) if r), None)
            if refusal is not None:  # a staging group's fused module left incomplete: nothing loaded
                raise EngineStateError(f"{self.host.name}: {operation}: {refusal}")
            seconds = time.perf_counter() - start
            self.state.version += loads_of(results)
            return results, seconds, await self.host.try_reset_prefix_cache()

    async def bucket(self, payload: Payload) -> dict[str, Any]:
        bucket = decode(self.host, "update_weights", WeightBucket, payload)
        try:
            bucket = validate_bucket(bucket)
        except ValueError as exc:
            raise EngineRequestError(f"{self.host.name}: update_weights: {exc}") from exc
        label = f"update_weights ({len(bucket.names)} tensors, first {bucket.names[0]!r})"
        _, seconds, reset = await self._receive(
            "update_weights",
            (label, RPC_RECEIVE, bucket.rpc_args()),
            lambda r: r if isinstance(r, str) else None,
            lambda _: 1,
        )
        logger.debug("%s: bucket of %d tensors in %.3fs", self.host.name, len(bucket.names), seconds)
        return {
            "num_tensors": len(bucket.names),
            "weight_version": self.state.version,
            "prefix_cache_reset": reset,
            "seconds": seconds,
        }

    async def stream(self, payload: Payload) -> dict[str, Any]:
        results, seconds, reset = await self._receive(
            "receive_weight_stream",
            ("receive_weight_stream", RPC_RECEIVE_STREAM, ()),
            lambda r: r.get("refused"),
            lambda rs: int(rs[0]["buckets"]),
        )
        receipt = {k: results[0][k] for k in ("buckets", "tensors", "bytes")}
        receipt.update(
            seconds=seconds,
            worker_seconds=max(r["seconds"] for r in results),
            direct_buckets=min(r.get("direct_buckets", 0) for r in results),
            weight_version=self.state.version,
            prefix_cache_reset=reset,
        )
        return receipt

    async def leave(self, payload: Payload) -> None:
        async with self.state.lock:
            results = await self.host.rpc(
                "destroy_weights_update_group", RPC_DESTROY, (), self.host.control_timeout_s
            )
            self.state.group_name = None
        pending = next((r for r in results if isinstance(r, str)), None)
        if pending is not None:
            raise EngineStateError(
                f"{self.host.name}: weight-update group destroyed with fused modules never completed, so "
                f"never loaded: {pending}"
            )

    async def has_group(self, payload: Payload) -> bool:
        if self.state.lock.locked():
            return self.state.group_name is not None
        results = await self.host.rpc(
            "has_weight_update_group", RPC_HAS_GROUP, (), self.host.control_timeout_s
        )
        return bool(results) and all(results)
