"""Joining the trainer's weight-update group without wedging the engine (the server side).

The workers join with a blocking RPC that vLLM runs on each worker's main thread, between model
steps. Two things there have no bound of their own: torch's store client waits forever for the
first answer of whatever accepted its connection (its ping), and a `collective_rpc` that times out
leaves vLLM's executor reading the next reply as this one's (the engine dies on a later step).
So `join_weight_update_group` first asks, from the event loop and bounded by the request's
`timeout_s`, whether a torch `TCPStore` answers at the group's address (torch's own validate and
ping messages, `probe_store`): an address nobody serves, a name that does not resolve or a peer
that is no store fails there with an `EngineRequestError` naming host and port, and the engine
is never involved (generation goes on meanwhile). With skylift's own protocol it then adds the
engine's ranks to the group's count of ranks on their way (`ANNOUNCED_KEY`; the trainer's rank 0
adds itself when it hosts the store) and waits, in a thread of the server, until every rank of the
group is counted (`await_every_rank`): ranks that never come fail there after `timeout_s`, naming
the address and how many came, and again the engine is never involved. Only then do the workers
join, under an RPC timeout longer than the worker's own bounds (store, rendezvous, handshake:
`timeout_s` each), so that a rendezvous that still fails ends with the worker's error, not the
RPC's. A trainer of the per-tensor protocol (`WeightUpdateGroupSpec.protocol`) announces nothing:
with it the workers join once the store answers, and late ranks hold the engine's step loop up to
the RPC's bound.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from skylift.utils.engine_errors import EngineError, EngineRequestError
from skylift.weight_sync.process_group import announce_ranks
from skylift.weight_sync.protocol import WeightUpdateGroupSpec

#: (operation, worker method, args, timeout_s) -> one result per worker
Rpc = Callable[[str, str, tuple, float], Awaitable[list[Any]]]

#: Seconds between two connection attempts.
POLL_S = 0.2
#: Seconds the join RPC waits beyond the worker's own bounds.
JOIN_GRACE_S = 15.0

# torch's TCPStore wire format (c10d TCPStore.cpp, native byte order): a client opens with
# VALIDATE and the magic number; PING carries a nonce the store sends back.
_QUERY_VALIDATE = 0
_QUERY_PING = 13
_VALIDATION_MAGIC = 0x3C85F7CE


class _NotAStore(Exception):
    """Something answered at the address, but not as a TCPStore."""


def _where(spec: WeightUpdateGroupSpec) -> str:
    return f"{spec.master_address}:{spec.master_port}"


def join_rpc_timeout_s(timeout_s: float) -> float:
    """The join RPC's timeout: the worker's store connection, rendezvous and handshake (each
    bounded by `timeout_s`), plus a grace."""
    return 3 * timeout_s + JOIN_GRACE_S


async def _ping(host: str, port: int, timeout_s: float) -> None:
    """One connection: validate, ping, read the nonce back (`TimeoutError`, `OSError`, `_NotAStore`)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        nonce = secrets.randbits(32)
        writer.write(
            struct.pack("=BI", _QUERY_VALIDATE, _VALIDATION_MAGIC) + struct.pack("=BI", _QUERY_PING, nonce)
        )
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.readexactly(4), timeout_s)
        except asyncio.IncompleteReadError as exc:
            raise _NotAStore(f"the peer closed the connection after {len(exc.partial)} bytes") from exc
        if struct.unpack("=I", answer)[0] != nonce:
            raise _NotAStore(f"the peer answered {answer!r} to a TCPStore ping")
    finally:
        writer.close()


async def probe_store(host: str, port: int, timeout_s: float) -> None:
    """Return once a torch TCPStore answers a ping at host:port; an `EngineRequestError` naming the
    address when none does within `timeout_s` (retrying refused connections, as a store may start a
    moment after the engines are told), when the name does not resolve, or when the peer is no
    store."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            await _ping(host, port, max(0.05, left))
        except socket.gaierror as exc:
            raise EngineRequestError(
                f"weight-update group rendezvous {host}:{port}: cannot resolve {host!r} ({exc})"
            ) from exc
        except _NotAStore as exc:
            raise EngineRequestError(
                f"weight-update group rendezvous {host}:{port}: something accepted the connection but "
                f"is no torch TCPStore ({exc}); check master_address and master_port"
            ) from exc
        except (OSError, TimeoutError) as exc:
            last = str(exc) or type(exc).__name__
        else:
            return
        if time.monotonic() + POLL_S >= deadline:
            raise EngineRequestError(
                f"no weight-update group rendezvous at {host}:{port}: no torch TCPStore answered there "
                f"within timeout_s={timeout_s:g} s (last error: {last}); check master_address and "
                "master_port: the trainer's rank 0 hosts the group's store there"
            )
        await asyncio.sleep(POLL_S)


def _count_ranks(spec: WeightUpdateGroupSpec, ranks: int, deadline: float) -> int:
    """Add `ranks` to the group's count of ranks on their way and poll it until it reaches
    `spec.world_size` or `deadline` passes (then the ranks are taken back); the count last seen."""
    from datetime import timedelta

    import torch.distributed as dist

    left = max(1.0, deadline - time.monotonic())
    store = dist.TCPStore(
        spec.master_address,
        spec.master_port,
        is_master=False,
        timeout=timedelta(seconds=left),
        wait_for_workers=False,
    )
    count = announce_ranks(store, spec.group_name, ranks)
    while count < spec.world_size and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)
        count = announce_ranks(store, spec.group_name, 0)
    if count < spec.world_size:
        announce_ranks(store, spec.group_name, -ranks)
    return count


async def await_every_rank(spec: WeightUpdateGroupSpec, ranks: int) -> None:
    """Count this engine's `ranks` as on their way into the group and return once all
    `spec.world_size` ranks are (off the event loop and off the engine); an `EngineRequestError`
    naming the address and how many came when they are not within `spec.timeout_s`."""
    deadline = time.monotonic() + spec.timeout_s
    try:
        count = await asyncio.to_thread(_count_ranks, spec, ranks, deadline)
    except RuntimeError as exc:  # the store went away between the probe and the count
        raise EngineRequestError(
            f"weight-update group rendezvous {_where(spec)}: the store stopped answering ({exc})"
        ) from exc
    if count < spec.world_size:
        raise EngineRequestError(
            f"weight-update group {spec.group_name!r} at {_where(spec)}: only {count} of its "
            f"{spec.world_size} ranks came within timeout_s={spec.timeout_s:g} s (the trainer's rank 0 "
            "and every engine's workers must join); this engine's workers were not asked to join "
            "and it keeps serving"
        )


async def join_weight_update_group(
    rpc: Rpc, spec: WeightUpdateGroupSpec, method: str, ranks: int = 1
) -> None:
    """Probe the rendezvous, wait for every rank (skylift's protocol), then have this engine's
    `ranks` workers join (see the module docstring); a join the workers report as failed is an
    `EngineRequestError` naming the address."""
    await probe_store(spec.master_address, spec.master_port, spec.timeout_s)
    if spec.protocol == "skylift":
        await await_every_rank(spec, ranks)
    try:
        bound = join_rpc_timeout_s(spec.timeout_s)
        await rpc("init_weight_update_communicator", method, spec.rpc_args(), bound)
    except EngineRequestError:
        raise
    except EngineError as exc:
        if "could not join" not in str(exc) and "handshake" not in str(exc):
            raise
        raise EngineRequestError(f"could not join the weight-update group at {_where(spec)}: {exc}") from exc
