"""Joining the weight-update group off the engine's step loop (the worker side).

vLLM runs a worker RPC on the worker's main thread, between model steps: a rendezvous that waits
there (a trainer that is late, an address nobody serves) stops generation for every client until
it times out, and a `collective_rpc` that times out leaves the engine unusable. So the join runs
in a thread of each worker: `skylift_start_join` starts it and returns at once, the server polls
`skylift_join_status` (quick RPCs between steps) until every worker has joined or failed, and
`skylift_discard_join` gives up on a join (a group that completes after that is destroyed).

For nccl the server keeps the blocking join (`RPC_INIT_GROUP`): NCCL communicators built on a
second thread while the model's own collectives run could deadlock; the server's TCP probe of the
rendezvous (`skylift.inference.rendezvous`) still keeps an unreachable address off the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

RPC_START_JOIN = "skylift_start_join"
RPC_JOIN_STATUS = "skylift_join_status"
RPC_DISCARD_JOIN = "skylift_discard_join"


class _Join:
    """One background join on one worker."""

    def __init__(self, where: str, timeout_s: float) -> None:
        self.where = where
        self.deadline = time.monotonic() + timeout_s
        self.state = "running"  # running | done | failed
        self.error: str | None = None
        self.discarded = False
        self.lock = threading.Lock()


class BackgroundJoinExtension:
    """Mixed into vLLM's workers beside the weight receiver (`skylift_init_weight_update_group`,
    `skylift_destroy_weight_update_group`)."""

    _skylift_join: _Join | None = None

    def skylift_start_join(self, *init_args: Any) -> None:
        """Start joining (the receiver's init arguments) in a thread; refused while one runs."""
        current = self._skylift_join
        if current is not None and current.state == "running":
            left = max(0.0, current.deadline - time.monotonic())
            raise RuntimeError(
                f"a previous weight-update group join ({current.where}) is still waiting, for at most "
                f"{left:.0f} s more; retry after it ends"
            )
        master_address, master_port, timeout_s = init_args[0], init_args[1], float(init_args[7])
        # torch bounds the store connection and the rendezvous by timeout_s each
        join = _Join(f"{master_address}:{master_port}", 2 * timeout_s + 5.0)
        self._skylift_join = join
        thread = threading.Thread(
            target=self._skylift_run_join, args=(join, init_args), name="skylift-join", daemon=True
        )
        thread.start()

    def _skylift_run_join(self, join: _Join, init_args: tuple[Any, ...]) -> None:
        try:
            self.skylift_init_weight_update_group(*init_args)  # type: ignore[attr-defined]
        except Exception as exc:  # reported to the server by skylift_join_status
            with join.lock:
                join.state, join.error = "failed", str(exc)
            logger.warning("weight-update group join failed: %s", exc)
            return
        with join.lock:
            join.state = "done"
            discarded = join.discarded
        if discarded:
            logger.warning("weight-update group at %s joined after the server gave up: left", join.where)
            self.skylift_destroy_weight_update_group()  # type: ignore[attr-defined]

    def skylift_join_status(self) -> dict[str, Any]:
        """The last join's state ("none", "running", "done", "failed") and error."""
        join = self._skylift_join
        if join is None:
            return {"state": "none", "error": None}
        with join.lock:
            return {"state": join.state, "error": join.error}

    def skylift_discard_join(self) -> None:
        """Give up on the last join: leave the group if it completed, or when it completes."""
        join = self._skylift_join
        if join is None:
            return
        with join.lock:
            join.discarded = True
            done = join.state == "done"
        if done:
            self.skylift_destroy_weight_update_group()  # type: ignore[attr-defined]
