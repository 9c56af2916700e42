"""`MixedTransport`: full weights to a mix of engines, each part of the pool served its own way.

`weight_sync.placed` builds one where the places call for more than one transport (the standard
GPU layout ``colocate_all=true`` on several GPUs: engine 0 shares rank 0's GPU, CUDA IPC; the
others have GPUs of their own, NCCL; on CPU, engines on rank 0's host take shared memory and the
others gloo). Each part is a transport over a view of the pool restricted to its engines
(`EnginePool.subset`): it only ever addresses its own engines, and an engine that fails in it is
taken out of the pool, which the other parts' views see too. The parts are opened, staged, pushed
and closed together, one after the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from skylift.utils.engine_errors import EngineUnavailableError
from skylift.weight_sync.transport import EngineSet, Say, WeightTransport


@dataclass
class Part:
    """One transport (`name`: "ipc", "nccl", "gloo") and the pool indices of the engines it serves."""

    name: str
    indices: list[int]
    engines: EngineSet
    transport: WeightTransport
    closed: bool = False  # its engines are all gone: closed, never pushed again


class MixedTransport(WeightTransport):
    """Pushes each version through every part in turn; `name` joins theirs ("ipc+nccl")."""

    def __init__(self, parts: list[Part], pool: EngineSet, say: Say) -> None:
        if len(parts) < 2:
            raise ValueError("a mixed transport has two parts or more")
        self.parts, self.pool, self.say = parts, pool, say

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.parts)

    @property
    def needs_prefix_reset(self) -> bool:  # type: ignore[override]
        return any(p.transport.needs_prefix_reset for p in self.parts)

    async def open(self) -> str:
        lines = []
        opened: list[Part] = []
        try:
            for part in self.parts:
                lines.append(f"engine(s) {part.indices}: {await part.transport.open()}")
                opened.append(part)
        except BaseException:
            await self._close(opened)
            raise
        return "; ".join(lines)

    async def _live(self) -> list[Part]:
        """The parts with an engine left; a part whose engines have all failed (taken out of the
        pool) is closed once (its group left, its shared buffers freed) and passed over."""
        live = []
        for part in self.parts:
            if part.closed:
                continue
            if part.engines.live_indices:
                live.append(part)
                continue
            part.closed = True
            self.say(
                f"weight sync: {part.name} engine(s) {part.indices} all left the pool: closing their transport"
            )
            try:
                await part.transport.close()
            except Exception as exc:  # noqa: BLE001 - its engines are gone; the others go on
                self.say(f"weight sync: closing the {part.name} transport: {type(exc).__name__}: {exc}")
        return live

    async def stage(self, version: int) -> None:
        for part in await self._live():
            await part.transport.stage(version)

    async def push(self, version: int) -> dict[str, float]:
        """Every part's push, one after the other (figures: each part's under
        ``weight_sync/<part>/``, the bytes summed, the whole push's time): each push gathers the policy's weights, and every
        policy rank takes part in each gather (a collective), so two pushes at once would interleave
        two gathers on the same ranks. A part whose last engine fails in its push is said and the
        others go on; with no engine left in the pool the error is raised (nothing loaded)."""
        start = time.perf_counter()
        out: dict[str, float] = {}
        for part in await self._live():
            try:
                pushed = await part.transport.push(version)
            except EngineUnavailableError as exc:  # the part's engines are gone (the pool took them out)
                if not self.pool.live_indices:
                    raise
                self.say(f"weight sync: {part.name} engines {part.indices} loaded nothing: {exc}")
                continue
            for key, value in pushed.items():  # each part's own figures under its name
                own = "push_s" if key == "timing/weight_sync_s" else key.rsplit("/", 1)[-1]
                out[f"weight_sync/{part.name}/{own}"] = value
                if key == "weight_sync/bytes":  # what the policy moved, all parts together
                    out[key] = out.get(key, 0.0) + value
        if not out:
            return {}  # nothing loaded anywhere: no figures
        out["timing/weight_sync_s"] = time.perf_counter() - start
        return out

    async def close(self) -> None:
        await self._close([p for p in self.parts if not p.closed])

    async def _close(self, parts: list[Part]) -> None:
        """Close every part, each even where another fails; the first failure is raised after."""
        failed: BaseException | None = None
        for part in parts:
            try:
                await part.transport.close()
            except Exception as exc:  # noqa: BLE001 - the others still close
                failed = failed or exc
        if failed is not None:
            raise failed
