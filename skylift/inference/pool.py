"""`EnginePool`: several engines behind one `InferenceEngine`.

Generation is spread by `LoadRouter` (least-loaded by sequences in flight; sticky by session id
for multi-turn); control calls go to every engine concurrently. Weight sync does not go through
the pool: the sender talks to each engine itself so that all of them join one process group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from skylift.inference.routing import LoadRouter
from skylift.inference.types import GenerateOutput, InferenceEngine, SamplingParams


class EnginePool:
    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.router = LoadRouter(len(self.engines))
        self.sequences_served = [0] * len(self.engines)

    def __repr__(self) -> str:
        return f"EnginePool({', '.join(repr(e) for e in self.engines)})"

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        if session_id is not None or len(self.engines) == 1:
            index = self.router.pick(session_id)
            return await self._on(index, prompts, params, session_id)
        owners = self.router.assign([params.n] * len(prompts))
        by_engine: dict[int, list[int]] = {}
        for i, owner in enumerate(owners):
            by_engine.setdefault(owner, []).append(i)
        results: list[GenerateOutput | None] = [None] * len(prompts)

        async def run(index: int, rows: list[int]) -> None:
            outs = await self._on(index, [prompts[i] for i in rows], params, None)
            for row, out in zip(rows, outs, strict=True):
                results[row] = out

        await asyncio.gather(*(run(index, rows) for index, rows in by_engine.items()))
        return [r for r in results if r is not None]

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
        return list(await asyncio.gather(*(getattr(e, method)(*args) for e in self.engines)))

    async def sleep(self, level: int = 1) -> None:
        await self._all("sleep", level)

    async def wake_up(self) -> None:
        await self._all("wake_up")

    async def reset_prefix_cache(self) -> None:
        await self._all("reset_prefix_cache")

    async def health(self) -> bool:
        return all(await self._all("health"))

    async def close(self) -> None:
        await self._all("close")
