"""The trainer process of `test_weight_group_abort`: a training run's weight-update group whose
engine dies while the group forms (what a local vLLM engine's core dying in
``init_weight_update_communicator`` looks like to the trainer).

The trainer half is the real one: the run's event loop (`LoopThread`), the driver's `PolicySync`
and the policy's rank 0 as `RLWorker` runs it in-process (`trainer.placement.backend=local`: its
``host_weight_group`` / ``join_weight_group`` / ``close_weight_group`` over a `WeightBroadcaster`).
The engine runs the real engine-side rendezvous (`broadcast.rendezvous`: probe the store, count
its ranks in, so that rank 0 is inside the group's rendezvous) and then fails its workers' join
as a dead engine core does. ``python weight_group_peer.py TIMEOUT_S`` prints one JSON line: how
long the failure took, its message, and how rank 0's own rendezvous ended; then the process
returns from main, and the test times its exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any

from skylift.cluster.worker_group import RLWorker
from skylift.utils.engine_errors import EngineError
from skylift.utils.loop_thread import LoopThread
from skylift.weight_sync.broadcast.rendezvous import join_weight_update_group
from skylift.weight_sync.policy_sync import PolicySync
from skylift.weight_sync.protocol import WeightUpdateGroupSpec


class Rank0:
    """The policy's rank 0 in this process, with `RLWorker`'s own weight-group methods."""

    rank = 0
    broadcaster = None
    host_weight_group = RLWorker.host_weight_group
    close_weight_group = RLWorker.close_weight_group
    _require_broadcaster = RLWorker._require_broadcaster

    def __init__(self) -> None:
        self.joined = threading.Event()
        self.join_outcome = "still waiting"

    def node_ip(self) -> str:
        return "127.0.0.1"

    def join_weight_group(self) -> None:
        try:
            RLWorker.join_weight_group(self)  # type: ignore[arg-type]
            self.join_outcome = "joined"
        except Exception as exc:
            self.join_outcome = str(exc)
            raise
        finally:
            self.joined.set()


class DyingEngine:
    """An engine whose core dies while its workers join the group."""

    def __repr__(self) -> str:
        return "DyingEngine(engine-0)"

    async def tensor_parallel_size(self) -> int:
        return 1

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        assert (transport, operation) == ("broadcast", "join")

        async def workers_join(*_: Any) -> list[Any]:
            await asyncio.sleep(0.5)  # rank 0 is in the rendezvous by now
            raise EngineError(
                "engine-0: init_weight_update_communicator failed: the vLLM engine process died "
                "(EngineDeadError)"
            )

        spec = WeightUpdateGroupSpec(**(payload or {}))
        return await join_weight_update_group(workers_join, spec, "init_weight_update_communicator")


def main() -> None:
    timeout_s = float(sys.argv[1])
    loop, rank0 = LoopThread(), Rank0()
    link = PolicySync(rank0, backend="gloo", timeout_s=timeout_s, master_address="127.0.0.1")  # type: ignore[arg-type]
    start = time.monotonic()
    try:
        loop.run(link.open([DyingEngine()]))  # type: ignore[list-item]
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    failed_after_s = time.monotonic() - start
    loop.stop()
    rank0.joined.wait(timeout_s)
    report = {"failed_after_s": failed_after_s, "error": error, "rank0": rank0.join_outcome}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
