"""`PolicySharedTransport`: a training run's policy -> engines on the policy's host, by handle.

The driver's half of the IPC transport in `skylift train` (`ipc.policy_rank` is the policy's):
no weight-update group. A push asks the policy's rank 0 for a streamed push into its kept
buffers (`shared_weights_plan`; on CPU the first push lays them out from the weights' layout);
with one, the engines load it bucket by bucket
(``weight_call("ipc", "load", ...)``) while every rank gathers and rank 0 fills
(`fill_shared_weights`); else every rank gathers and rank 0 copies into new buffers
(`share_weights`), the engines load them, and rank 0 frees them unless it keeps them for the next
push. `weight_sync.topology` says when it fits (`weight_sync.placed` applies it): an engine on the
policy's GPU (where NCCL refuses), or engines on the policy's host (CPU: shared memory).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from skylift.weight_sync.ipc.policy_rank import SharedWeightsRank
from skylift.weight_sync.transport import EngineSet, Say, WeightTransport


class PolicyCalls(Protocol):
    """The policy's ranks (`skylift.cluster.worker_group.WorkerGroup`): a method on rank 0 or on
    every rank in lockstep (blocking; run in a thread here)."""

    def call_rank0(self, method: Any, *args: Any, **kwargs: Any) -> Any: ...
    def call_all(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]: ...


class PolicySharedTransport(WeightTransport):
    """Full weights policy rank 0 -> every live engine, by shared-memory / CUDA IPC handle.

    `dtype`: the engines' weight dtype (floating tensors cast on rank 0; None: as trained).
    `keep_buffers`: on CPU, keep the buffers between pushes and stream into them (see
    `ipc.policy_rank`); CUDA buffers are never kept (they would hold a second copy of the weights
    on the GPU). `bucket_bytes`: the streamed push's bucket size."""

    kind = "ipc"

    def __init__(
        self,
        policy: PolicyCalls,
        engines: EngineSet,
        say: Say,
        *,
        dtype: str | None = None,
        keep_buffers: bool = True,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        self.policy, self.engines, self.say = policy, engines, say
        self.dtype, self.keep_buffers, self.bucket_bytes = dtype, keep_buffers, bucket_bytes

    async def open(self) -> str:
        mode = "kept buffers, streamed" if self.keep_buffers else "new buffers each push"
        return (
            f"weight sync: {len(self.engines.engines)} engine(s) on the policy's host load its weights "
            f"by handle (CUDA IPC on a GPU, shared memory on CPU; {mode})"
        )

    def _rank0(self, method: Any, *args: Any) -> Any:
        return asyncio.to_thread(self.policy.call_rank0, method, *args)

    def _all(self, method: Any, *args: Any) -> Any:
        return asyncio.to_thread(self.policy.call_all, method, *args)

    async def _load(self, payload: dict[str, Any]) -> list[Any]:
        return list(await self.engines.weight_call("ipc", "load", payload, strict=False))

    async def _streamed(self, plan: dict[str, Any]) -> tuple[int, list[Any]]:
        calls = asyncio.ensure_future(self._load(plan))
        try:
            filled = await self._all(SharedWeightsRank.fill_shared_weights, plan["buckets"], self.dtype)
        except BaseException:
            await asyncio.gather(calls, return_exceptions=True)  # the workers stop at the -1 counter
            raise
        return int(filled[0]), await calls

    async def _fresh(self) -> tuple[int, list[Any]]:
        shared = (await self._all(SharedWeightsRank.share_weights, self.dtype, self.keep_buffers))[0]
        try:
            return int(shared["bytes"]), await self._load({"handle": shared["handle"]})
        finally:
            if not shared["kept"]:
                await self._rank0(SharedWeightsRank.release_shared_weights)

    async def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        plan = await self._rank0(
            SharedWeightsRank.shared_weights_plan, self.bucket_bytes, self.dtype, self.keep_buffers
        )
        nbytes, results = await (self._streamed(plan) if plan is not None else self._fresh())
        return {
            "timing/weight_sync_s": time.perf_counter() - start,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/engines": float(len(results)),
            "weight_sync/streamed": float(plan is not None),
        }

    async def close(self) -> None:
        await release_engines(self.engines, self.say)
        await self._rank0(SharedWeightsRank.release_shared_weights, True)


async def release_engines(engines: EngineSet, say: Say) -> None:
    """Tell every live engine to drop the views its workers keep of the sender's buffers; an
    engine that cannot (gone, or an older server) is said, not raised: its mapping goes with it.
    With no engine left (each failed, said when it was taken out) there is nothing to tell."""
    if not engines.live_indices:
        return
    try:
        await engines.weight_call("ipc", "release", {}, strict=False)
    except Exception as exc:  # noqa: BLE001 - closing goes on
        say(f"weight sync: the engines could not release the shared buffers ({type(exc).__name__}: {exc})")
