"""Joining the trainer's weight-update group without stopping generation (the server side).

`join_weight_update_group` first waits, on the event loop, until something accepts a TCP
connection at the group's address (the trainer's rank 0 hosts the store there, maybe a moment
after telling the engines): an address nobody serves fails there, after the request's timeout,
with a 400 that names it, and never reaches the engine. Then the workers join: for gloo in a
thread of each worker, polled with quick RPCs (`skylift.inference.join_worker`), so the engine
keeps stepping while the other ranks arrive; for nccl with the blocking RPC.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from skylift.inference.join_worker import RPC_DISCARD_JOIN, RPC_JOIN_STATUS, RPC_START_JOIN
from skylift.inference.types import EngineRequestError, EngineStateError, WeightUpdateGroupSpec

#: (operation, worker method, args, timeout_s) -> one result per worker
Rpc = Callable[[str, str, tuple, float], Awaitable[list[Any]]]

#: Seconds between two connection attempts / two status polls.
POLL_S = 0.2
#: Seconds a background join may run beyond its two torch timeouts (store, rendezvous).
JOIN_GRACE_S = 10.0


def _where(spec: WeightUpdateGroupSpec) -> str:
    return f"{spec.master_address}:{spec.master_port}"


async def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once a TCP connection to host:port is accepted (then closed); an `EngineRequestError`
    naming the address when none is within `timeout_s` or the name does not resolve."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), max(0.05, min(left, 5.0)))
        except socket.gaierror as exc:
            raise EngineRequestError(
                f"weight-update group rendezvous {host}:{port}: cannot resolve {host!r} ({exc})"
            ) from exc
        except (OSError, TimeoutError) as exc:
            last = str(exc) or type(exc).__name__
        else:
            writer.close()
            return
        if time.monotonic() + POLL_S >= deadline:
            raise EngineRequestError(
                f"no weight-update group rendezvous at {host}:{port}: nothing accepted a TCP connection "
                f"there within timeout_s={timeout_s:g} s (last error: {last}); check master_address and "
                "master_port: the trainer's rank 0 hosts the group's store there"
            )
        await asyncio.sleep(POLL_S)


async def _statuses(rpc: Rpc, control_timeout_s: float) -> list[dict[str, Any]]:
    return await rpc("weight-update group join status", RPC_JOIN_STATUS, (), control_timeout_s)


async def join_in_background(rpc: Rpc, spec: WeightUpdateGroupSpec, control_timeout_s: float) -> None:
    """Have every worker join in a thread and wait (polling) until all did; on a failure or after
    the join's own bound, leave whatever joined and raise an `EngineRequestError`."""
    if any(s["state"] == "running" for s in await _statuses(rpc, control_timeout_s)):
        raise EngineStateError(
            f"a previous weight-update group join is still waiting on the workers; retry after its "
            f"timeout ({_where(spec)} asked now)"
        )
    await rpc("start weight-update group join", RPC_START_JOIN, spec.rpc_args(), control_timeout_s)
    try:
        await _poll_join(rpc, spec, control_timeout_s)
    except asyncio.CancelledError:  # the client left: leave the group whenever the join ends
        await asyncio.shield(rpc("discard weight-update group join", RPC_DISCARD_JOIN, (), control_timeout_s))
        raise


async def _poll_join(rpc: Rpc, spec: WeightUpdateGroupSpec, control_timeout_s: float) -> None:
    bound = 2 * spec.timeout_s + JOIN_GRACE_S
    deadline = time.monotonic() + bound
    while True:
        statuses = await _statuses(rpc, control_timeout_s)
        failed = next((s["error"] for s in statuses if s["state"] == "failed"), None)
        if failed is None and all(s["state"] == "done" for s in statuses):
            return
        if failed is not None or time.monotonic() > deadline:
            await rpc("discard weight-update group join", RPC_DISCARD_JOIN, (), control_timeout_s)
            reason = failed or f"not every rank arrived within {bound:g} s"
            raise EngineRequestError(f"could not join the weight-update group at {_where(spec)}: {reason}")
        await asyncio.sleep(POLL_S)


async def join_weight_update_group(
    rpc: Rpc, spec: WeightUpdateGroupSpec, blocking_method: str, control_timeout_s: float
) -> None:
    """Probe the rendezvous, then join (see the module docstring)."""
    await wait_for_listener(spec.master_address, spec.master_port, spec.timeout_s)
    if spec.backend == "gloo":
        await join_in_background(rpc, spec, control_timeout_s)
    else:
        await rpc("init_weight_update_communicator", blocking_method, spec.rpc_args(), spec.timeout_s)
