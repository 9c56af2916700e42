"""`PlacedTransport`: a training run's full-weight transport, chosen where the ranks really are.

At `open` (the engines are up) the policy's rank 0 and every engine worker say where they run
(`ipc.place`: host, CPU or the physical GPU's UUID; the engines through the IPC engine side's
``places``), and `weight_sync.topology` picks the transport from those places:

- ``auto``: every engine ``ipc`` (a worker on rank 0's GPU: CUDA IPC; on CPU, engines on rank
  0's host: shared memory, where /dev/shm holds the weights, else gloo) ->
  `ipc.policy_transport.PolicySharedTransport`; every engine ``nccl`` or every
  engine ``gloo`` -> `broadcast.transport.BroadcastTransport` over that backend; a mix with
  ``ipc`` engines (``colocate_all`` on several GPUs: engine 0 on rank 0's GPU) -> each engine its
  own way (`mixed.MixedTransport`, named "ipc+nccl" / "ipc+gloo"): `PolicySharedTransport` for the
  ``ipc`` engines and one group for the others (NCCL where they all take NCCL, else gloo), each
  over a view of the pool restricted to its engines (`EnginePool.subset`); on CPU where /dev/shm
  cannot hold the weights, and for an engine set that cannot be split, one gloo group for all (it
  carries every layout, NCCL would refuse a same-GPU pair); a mix of ``nccl`` and ``gloo``
  engines: one gloo group;
- a forced backend (``nccl``, ``gloo``, ``ipc``) is checked against the places
  (`topology.check_forced`: one line saying why it cannot work and what to use) and used.

A LoRA policy's adapter (`adapter=True`) goes over a group chosen the same way: NCCL where every
engine is on GPUs other than rank 0's, else gloo (an engine on rank 0's GPU or host, CPU, a mix).

Engines that cannot say where they run (an older server) get the broadcast path with the
backend the config alone gives (`factory.group_backend`), said in the open line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from skylift.weight_sync.ipc.place import place_from_wire
from skylift.weight_sync.ipc.policy_rank import SharedWeightsRank
from skylift.weight_sync.mixed import MixedTransport, Part
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.topology import Place, Transport, check_forced, choose_transports, shared_memory_fits
from skylift.weight_sync.transport import EngineSet, Say, WeightTransport

#: builds the transport for one choice: "ipc", or a group backend ("nccl", "gloo", None: the
#: config's own, `factory.group_backend`), over these engines (the whole set, or a part of a mix)
Build = Callable[[str | None, EngineSet], WeightTransport]


def resolve(backend: str, trainer: Place, engines: list[list[Place]]) -> tuple[str, str]:
    """(transport, why) for `backend` ("auto" or forced) and these places, where one transport
    serves every engine (a LoRA adapter's group; full weights where the engines agree): "ipc",
    "nccl" or "gloo", a mix under ``auto`` "gloo" (`split` says how full weights serve a mix
    instead). A forced backend that cannot work raises `WeightSyncError` (one line)."""
    if backend != "auto":
        check_forced(backend, trainer, engines)
        return backend, "forced by generator.weight_sync_backend"
    choices: list[Transport] = choose_transports(trainer, engines)
    kinds = sorted(set(choices))
    where = _where(trainer, engines)
    if len(kinds) == 1:
        return kinds[0], where
    return "gloo", f"{where}: engines need {' and '.join(kinds)}, one gloo group carries both"


def split(choices: list[Transport]) -> tuple[list[int], str, list[int]] | None:
    """Full weights to a mix under ``auto``: (the engines that take ``ipc``, the backend of one
    group for the others, those others), positions in `choices`; None where no engine takes
    ``ipc`` or every engine does (one transport serves them all). The others' group is NCCL where
    they all take NCCL, else gloo (it carries both)."""
    ipc = [k for k, c in enumerate(choices) if c == "ipc"]
    rest = [k for k, c in enumerate(choices) if c != "ipc"]
    if not ipc or not rest:
        return None
    return ipc, ("nccl" if all(choices[k] == "nccl" for k in rest) else "gloo"), rest


def _where(trainer: Place, engines: list[list[Place]]) -> str:
    return f"policy rank 0 on {_describe(trainer)}; engines on " + ", ".join(
        "/".join(sorted({_describe(w) for w in workers})) for workers in engines
    )


def _describe(place: Place) -> str:
    return f"{place.host} {place.device}" + (f" GPU {place.gpu[:12]}" if place.gpu else "")


class PlacedTransport(WeightTransport):
    """Delegates to the transport the ranks' places call for (chosen at `open`)."""

    def __init__(
        self,
        backend: str,
        policy: Any,
        engines: EngineSet,
        say: Say,
        build: Build,
        dtype: str | None = None,
        adapter: bool = False,
    ) -> None:
        self.backend, self.policy, self.engines, self.say, self.build = backend, policy, engines, say, build
        self.dtype = dtype  # what the engines get (None: as trained): sizes the shared-memory check
        #: a LoRA adapter over a group (`lora.LoraTransport`): where an engine shares rank 0's GPU
        #: or host ("ipc" for full weights) the group is gloo, which carries a same-GPU pair
        self.adapter = adapter
        self.chosen: str | None = None
        self.inner: WeightTransport | None = None

    async def places(self) -> tuple[Place, list[list[Place]]] | None:
        """(rank 0's place, each live engine's workers' places), or None when an engine cannot say."""
        trainer = await asyncio.to_thread(self.policy.call_rank0, SharedWeightsRank.weight_sync_place)
        try:
            answers = await self.engines.weight_call("ipc", "places", {}, strict=True)
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine without the operation: config alone decides
            self.say(f"weight sync: the engines cannot say where they run ({type(exc).__name__}: {exc})")
            return None
        try:
            return place_from_wire(trainer), [[place_from_wire(w) for w in workers] for workers in answers]
        except (ValueError, TypeError) as exc:
            self.say(f"weight sync: an engine's place does not decode ({exc})")
            return None

    async def open(self) -> str:
        places = await self.places()
        if places is None:
            if self.backend == "ipc":
                raise WeightSyncError(
                    "weight_sync_backend=ipc cannot work: the engines cannot say where they run, so "
                    "sharing by handle cannot be checked; use weight_sync_backend=auto"
                )
            return await self._open_one(None, "the engines' places unknown: the config's backend")
        chosen, why = resolve(self.backend, *places)
        parts = split(choose_transports(*places)) if self.backend == "auto" and not self.adapter else None
        if parts is not None:
            return await self._open_mixed(parts, *places)
        if chosen == "ipc" and self.adapter:
            chosen, why = "gloo", f"{why}: a LoRA adapter goes over a gloo group there"
        elif chosen == "ipc" and self.backend == "auto" and places[0].device == "cpu":
            chosen, why = await self._shared_memory_or_gloo(why)
        return await self._open_one(chosen, why)

    async def _open_one(self, chosen: str | None, why: str) -> str:
        self.chosen = chosen or "broadcast"
        self.inner = self.build(chosen, self.engines)
        line = await self.inner.open()
        return f"{line} [{self.chosen}: {why}]"

    async def _open_mixed(
        self, parts: tuple[list[int], str, list[int]], trainer: Place, engines: list[list[Place]]
    ) -> str:
        """Full weights to a mix under ``auto``: each engine its own way (`mixed.MixedTransport`),
        ``ipc`` for those on rank 0's GPU (on CPU: host, where /dev/shm holds the weights), one
        group for the others, each over a view of the pool restricted to its engines
        (`EnginePool.subset`). Where that cannot be (no room in /dev/shm; an engine set that cannot
        be split), one gloo group carries every engine."""
        ipc, backend, rest = parts
        why = f"{_where(trainer, engines)}: engines need ipc and {backend}"
        if trainer.device == "cpu":
            chosen, why = await self._shared_memory_or_gloo(why)
            if chosen == "gloo":
                return await self._open_one("gloo", f"{why}, one gloo group carries every engine")
        subset = getattr(self.engines, "subset", None)
        if subset is None:
            return await self._open_one(
                "gloo", f"{why}: this engine set cannot be split, one gloo group carries both"
            )
        live = self.engines.live_indices  # the places are the live engines', in this order
        mixed = []
        for name, positions in (("ipc", ipc), (backend, rest)):
            indices = [live[k] for k in positions]
            part: EngineSet = subset(indices)
            mixed.append(Part(name, indices, part, self.build(name, part)))
        self.inner = MixedTransport(mixed, self.engines, self.say)
        self.chosen = self.inner.name
        line = await self.inner.open()
        return (
            f"weight sync, each engine its own way: {line} [{self.chosen}: {why}: ipc for engine(s) "
            f"{mixed[0].indices}, one {backend} group for engine(s) {mixed[1].indices}]"
        )

    async def _shared_memory_or_gloo(self, why: str) -> tuple[str, str]:
        """`auto`'s CPU choice: shared memory where /dev/shm holds the weights, else gloo."""
        room = await asyncio.to_thread(
            self.policy.call_rank0, SharedWeightsRank.shared_memory_room, self.dtype
        )
        fits, because = shared_memory_fits(room.get("need"), room.get("free"))
        return ("ipc", f"{why}; shared memory") if fits else ("gloo", f"{why}; {because}: gloo")

    def _require(self) -> WeightTransport:
        if self.inner is None:
            raise WeightSyncError("weight sync: open() the transport before a push")
        return self.inner

    @property
    def name(self) -> str:
        """The transport chosen at open ("ipc", "gloo", "nccl"; "broadcast": the config's backend)."""
        return self.inner.name if self.inner is not None else "unopened"

    @property
    def needs_prefix_reset(self) -> bool:  # type: ignore[override]
        return self.inner.needs_prefix_reset if self.inner is not None else True

    async def stage(self, version: int) -> None:
        await self._require().stage(version)

    async def push(self, version: int) -> dict[str, float]:
        return await self._require().push(version)

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()
