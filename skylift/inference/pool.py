"""`EnginePool`: several engines behind one `InferenceEngine`, with failover.

Generation is spread by `LoadRouter` (least-loaded by sequences in flight; sticky by session id
for multi-turn); control calls go to every engine concurrently. An engine that fails with
`EngineUnavailableError` (process killed, connection refused, no answer in time) is taken out of
the pool and its requests are retried on the others; with none left, `NoHealthyEngineError`
names every engine and why it failed. Weight sync does not go through the pool: the sender talks
to each engine itself so that all of them join one process group (see `live_indices`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from skylift.inference.routing import LoadRouter, NoServerLeftError
from skylift.inference.types import EngineUnavailableError, GenerateOutput, InferenceEngine, SamplingParams

logger = logging.getLogger("skylift.inference.pool")


class NoHealthyEngineError(EngineUnavailableError):
    """Every engine of a pool has failed; the message says which failed how."""


class EnginePool:
    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.router = LoadRouter(len(self.engines))
        self.sequences_served = [0] * len(self.engines)
        self.failures: dict[int, str] = {}  # engine index -> why it was taken out of the pool

    def __repr__(self) -> str:
        return f"EnginePool({', '.join(repr(e) for e in self.engines)})"

    @property
    def live_indices(self) -> list[int]:
        """Indices of the engines still in service (the router's; `failures` says why the others left)."""
        return self.router.enabled

    def mark_failed(self, index: int, reason: BaseException | str) -> None:
        """Take engine `index` out of service (idempotent); later requests avoid it."""
        if index in self.failures:
            return
        self.failures[index] = str(reason)
        self.router.disable(index)
        left = len(self.live_indices)
        logger.warning(
            "engine %d (%r) taken out of service: %s; %d engine(s) left",
            index,
            self.engines[index],
            reason,
            left,
        )

    def _no_engine_left(self) -> NoHealthyEngineError:
        detail = "; ".join(
            f"engine {i} ({self.engines[i]!r}): {why}" for i, why in sorted(self.failures.items())
        )
        return NoHealthyEngineError(
            f"no healthy inference engine left ({len(self.engines)} failed): {detail}"
        )

    def _pick(self, session_id: str | None) -> int:
        try:
            return self.router.pick(session_id)
        except NoServerLeftError:
            raise self._no_engine_left() from None

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        if session_id is not None or len(self.live_indices) <= 1:
            return await self._with_failover(self._pick(session_id), prompts, params, session_id)
        try:
            owners = self.router.assign([params.n] * len(prompts))
        except NoServerLeftError:
            raise self._no_engine_left() from None
        by_engine: dict[int, list[int]] = {}
        for i, owner in enumerate(owners):
            by_engine.setdefault(owner, []).append(i)
        results: list[GenerateOutput | None] = [None] * len(prompts)

        async def run(index: int, rows: list[int]) -> None:
            outs = await self._with_failover(index, [prompts[i] for i in rows], params, None)
            for row, out in zip(rows, outs, strict=True):
                results[row] = out

        await asyncio.gather(*(run(index, rows) for index, rows in by_engine.items()))
        return [r for r in results if r is not None]

    async def _with_failover(
        self, index: int, prompts: list[list[int]], params: SamplingParams, session_id: str | None
    ) -> list[GenerateOutput]:
        """Run on engine `index`; if it is unavailable, take it out and retry on another."""
        while True:
            try:
                return await self._on(index, prompts, params, session_id)
            except EngineUnavailableError as exc:
                self.mark_failed(index, exc)
                index = self._pick(session_id)
                logger.warning(
                    "retrying %d prompt(s) on engine %d (%r)", len(prompts), index, self.engines[index]
                )

    async def _on(
        self, index: int, prompts: list[list[int]], params: SamplingParams, session_id: str | None
    ) -> list[GenerateOutput]:
        weight = len(prompts) * params.n
        self.router.acquire(index, weight)
        try:
            out = await self.engines[index].generate(prompts, params, session_id)
        finally:
            self.router.release(index, weight)
        self.sequences_served[index] += weight
        return out

    async def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every live engine concurrently; an unavailable one is taken out."""
        live = self.live_indices
        if not live:
            raise self._no_engine_left()
        results = await asyncio.gather(
            *(getattr(self.engines[i], method)(*args) for i in live), return_exceptions=True
        )
        for i, result in zip(live, results, strict=True):
            if isinstance(result, EngineUnavailableError):
                self.mark_failed(i, result)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not all(isinstance(e, EngineUnavailableError) for e in errors):
            raise next(e for e in errors if not isinstance(e, EngineUnavailableError))
        if not self.live_indices:
            raise self._no_engine_left()
        return [r for r in results if not isinstance(r, BaseException)]

    async def probe(self, timeout_s: float = 10.0) -> list[int]:
        """Ask every live engine for its health; engines that fail or do not answer are taken out.
        Returns the indices still live."""

        async def one(i: int) -> None:
            try:
                healthy = await asyncio.wait_for(self.engines[i].health(), timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure to answer is unhealthy
                self.mark_failed(i, f"health check failed: {exc!r}")
                return
            if not healthy:
                self.mark_failed(i, "health check answered unhealthy")

        await asyncio.gather(*(one(i) for i in self.live_indices))
        return self.live_indices

    async def sleep(self, level: int = 1) -> None:
        await self._all("sleep", level)

    async def wake_up(self) -> None:
        await self._all("wake_up")

    async def reset_prefix_cache(self) -> None:
        await self._all("reset_prefix_cache")

    async def health(self) -> bool:
        return bool(self.live_indices) and all(await self._all("health"))

    async def close(self) -> None:
        """Close every engine, failed ones included (best effort for those)."""
        results = await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException) and i not in self.failures:
                raise result
