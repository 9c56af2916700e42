"""`EngineGroup`: the engines' side of the weight-update group, driven by whoever owns the engines.

Weight sync has two halves. Rank 0 of the group (`weight_sync.broadcast.broadcaster.WeightBroadcaster`, in
the policy's rank 0) produces and broadcasts; it knows no engine. `EngineGroup` holds the engine
clients (`WeightSyncTarget`s) and tells them to join, to receive and to leave, each time
concurrently with rank 0's half, which it gets as an awaitable: both sides block until the other
arrives. The training driver (`cluster.engine_weights`) runs it with the policy's Ray calls;
`WeightSender` runs it with a broadcaster in its own process.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from skylift.utils.calls import call_with_timeout, gather_all
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.protocol import (
    DEFAULT_GROUP_NAME,
    WeightBucket,
    WeightSyncTarget,
    WeightUpdateGroupSpec,
)

#: How rank 0 hosts the group: (world size) -> (address, port) its store listens on, and the
#: backend (rank 0 resolves the default: nccl where it has CUDA, else gloo).
Host = Callable[[int], Awaitable[tuple[str, int, str]]]


class EngineGroup:
    """The engines of one weight-update group (rank 0 elsewhere; engine workers after it).

    `timeout_s` bounds the rendezvous and the group's tear-down; `update_timeout_s` one engine
    call end to end (metadata, broadcast and the engines' reload).
    """

    def __init__(
        self,
        engines: Sequence[WeightSyncTarget],
        *,
        timeout_s: float = 120.0,
        update_timeout_s: float = 600.0,
    ) -> None:
        if not engines:
            raise WeightSyncError("a weight-update group needs at least one engine")
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s
        self.address: str | None = None  # where the engines dialled rank 0 (set by `open`)

    def _call(self, index: int, what: str, aw: Awaitable[Any], timeout_s: float) -> Awaitable[Any]:
        who = f"engine {index} ({self.engines[index]!r})"
        return call_with_timeout(
            who, what, aw, timeout_s, timeout_error=WeightSyncError, error=WeightSyncError
        )

    def _rank_zero(self, what: str, aw: Awaitable[Any], timeout_s: float) -> Awaitable[Any]:
        return call_with_timeout("sender (rank 0)", what, aw, timeout_s, timeout_error=WeightSyncError)

    async def each(
        self, what: str, call: Callable[[WeightSyncTarget], Awaitable[Any]], *, fail_fast: bool = True
    ) -> list[Any]:
        """`call(engine)` on every engine concurrently (`what` names it in errors). `fail_fast`:
        the first failure cancels the rest and is raised; else each result or its exception."""
        tasks = [self._call(i, what, call(e), self.update_timeout_s) for i, e in enumerate(self.engines)]
        return await gather_all(tasks, fail_fast=fail_fast)

    async def with_rank_zero(
        self,
        what: str,
        rank_zero: Awaitable[Any],
        engines_what: str,
        call: Callable[[WeightSyncTarget], Awaitable[Any]],
    ) -> tuple[Any, list[Any]]:
        """Rank 0's half (`what`) and `call(engine)` on every engine (`engines_what`) concurrently;
        the first failure cancels the rest and is raised. Returns (rank 0's result, the engines')."""
        tasks = [self._rank_zero(what, rank_zero, self.update_timeout_s)]
        tasks += [
            self._call(i, engines_what, call(e), self.update_timeout_s) for i, e in enumerate(self.engines)
        ]
        first, *rest = await gather_all(tasks, fail_fast=True)
        return first, rest

    async def open(
        self,
        host: Host,
        join: Callable[[], Awaitable[Any]],
        *,
        override_existing: bool = False,
        group_name: str = DEFAULT_GROUP_NAME,
    ) -> str:
        """Build the group: the engines' sizes give the world size, rank 0 hosts the store
        (`host`), then rank 0 (`join()`) and every engine meet. Returns the address dialled.

        The first side to fail fails the rendezvous at once, a `WeightSyncError` naming the group's
        address and the side; rank 0's `join` may still be waiting then: the caller closes rank
        0's side (`WeightBroadcaster.close`), which ends it."""
        tp_sizes = await gather_all(
            [
                self._call(i, "tensor_parallel_size", e.tensor_parallel_size(), self.timeout_s)
                for i, e in enumerate(self.engines)
            ],
            fail_fast=True,
        )
        world_size = 1 + sum(tp_sizes)
        address, port, backend = await host(world_size)

        def spec(i: int) -> WeightUpdateGroupSpec:
            return WeightUpdateGroupSpec(
                master_address=address,
                master_port=port,
                rank_offset=1 + sum(tp_sizes[:i]),
                world_size=world_size,
                group_name=group_name,
                backend=backend,  # type: ignore[arg-type]
                override_existing=override_existing,
                timeout_s=self.timeout_s,
            )

        try:
            await gather_all(
                [
                    self._rank_zero("group rendezvous", join(), self.timeout_s + 10.0),
                    *[
                        self._call(
                            i,
                            "init_weight_update_communicator",
                            e.weight_call("broadcast", "join", spec(i).to_dict()),
                            self.timeout_s + 30.0,
                        )
                        for i, e in enumerate(self.engines)
                    ],
                ],
                fail_fast=True,
            )
        except WeightSyncError as exc:  # both ends: where rank 0 waited, and who failed
            raise WeightSyncError(
                f"weight-update group {group_name!r} did not form between rank 0 (hosting it at "
                f"{address}:{port}) and {len(self.engines)} engine(s) (world size {world_size}): {exc}"
            ) from exc
        self.address = address
        return address

    async def receive_stream(self, broadcast: Awaitable[Any]) -> tuple[Any, list[Any]]:
        """Every engine receives one weight stream while rank 0 `broadcast`s it; returns
        (rank 0's result, each engine's receipt)."""
        return await self.with_rank_zero(
            "weight stream broadcast",
            broadcast,
            "receive_weight_stream",
            lambda e: e.weight_call("broadcast", "stream"),
        )

    async def receive_bucket(self, bucket: WeightBucket, broadcast: Awaitable[Any]) -> None:
        """Every engine receives and loads one bucket while rank 0 `broadcast`s its buffers."""
        what = f"update_weights ({len(bucket.names)} tensors)"
        await self.with_rank_zero(
            "broadcast", broadcast, what, lambda e: e.weight_call("broadcast", "bucket", bucket.to_dict())
        )

    async def close(self, leave: Callable[[], Awaitable[Any]]) -> None:
        """Destroy the group on every engine, then on rank 0 (`leave()`); errors of engines that
        cannot be reached any more are collected and raised after rank 0 left."""
        results = await gather_all(
            [
                self._call(
                    i,
                    "destroy_weights_update_group",
                    e.weight_call("broadcast", "leave"),
                    self.timeout_s,
                )
                for i, e in enumerate(self.engines)
            ]
        )
        await leave()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError("; ".join(str(e) for e in errors))
