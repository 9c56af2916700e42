"""`EnginePool`: several engines behind one `InferenceEngine`, with failover.

Generation is spread by `LoadRouter` (least-loaded by sequences in flight; sticky by session id
for multi-turn); a single-engine call (`prompt_logprobs`, `render_chat_completion`) goes to the
least-loaded engine; control calls go to every engine concurrently. An engine that fails with
`EngineUnavailableError` (process killed, connection refused, no answer in time) is taken out of
the pool and its requests are retried on the others; with none left, `NoHealthyEngineError`
names every engine and why it failed.

Weight-sync calls (`weight_call`, the one generic path of `weight_sync.engine_side`) go to every
live engine too, as one `WeightSyncTarget` whose workers are those of all engines (server i takes
the ranks after servers 0..i-1); they are never retried, since a broadcast cannot be replayed.
The trainer instead hands the sender the live engines themselves (`live_indices`), so that a dead
one can be left out of a new group.

`EngineSubset` (`EnginePool.subset`) is some of a pool's engines as an engine set of their own: a
weight transport that serves only those (`weight_sync.mixed`: shared memory / CUDA IPC for the
engines on the policy's host or GPU, a group for the others). Its `engines` are its own only, so a
transport that addresses engines directly (a group's clients) reaches no other; its calls go
through the pool restricted to its indices (`only`), with the pool's failure handling: an engine
that fails is taken out of the pool itself, and every view of the pool sees it gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

from skylift.inference.routing import LoadRouter, NoServerLeftError
from skylift.inference.types import (
    EngineUnavailableError,
    GenerateOutput,
    InferenceEngine,
    PauseMode,
    SamplingParams,
)
from skylift.utils.calls import call_with_timeout, gather_all

logger = logging.getLogger("skylift.inference.pool")

T = TypeVar("T")


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

    @classmethod
    def from_urls(cls, urls: Sequence[str], **engine_kwargs: Any) -> EnginePool:
        """A pool of `RemoteInferenceEngine`s, one per skylift server URL (`engine_kwargs`:
        api_key, timeout_s, max_retries, backoff_s, session_pool...)."""
        from skylift.inference.remote import RemoteInferenceEngine

        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("an engine pool needs at least one server URL")
        engines = [RemoteInferenceEngine(url, **engine_kwargs) for url in urls]
        seen = [e.url for e in engines]
        if len(set(seen)) != len(seen):
            raise ValueError(f"duplicate server URLs: {seen}")
        return cls(engines)

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

    def _no_engine_left(self, only: Collection[int] | None = None) -> NoHealthyEngineError:
        among = range(len(self.engines)) if only is None else sorted(only)
        detail = "; ".join(f"engine {i} ({self.engines[i]!r}): {self.failures.get(i)}" for i in among)
        if only is None:
            return NoHealthyEngineError(
                f"no healthy inference engine left ({len(self.engines)} failed): {detail}"
            )
        return NoHealthyEngineError(
            f"no healthy inference engine left among engines {list(among)} of the pool ({len(self.live_indices)} "
            f"live elsewhere): {detail}"
        )

    def _live(self, only: Collection[int] | None) -> list[int]:
        return [i for i in self.live_indices if only is None or i in only]

    def subset(self, indices: Sequence[int]) -> EngineSubset:
        """A view of engines `indices` only (a transport that serves some of the engines): its calls
        reach those engines alone, and an engine that fails in it is taken out of this pool."""
        return EngineSubset(self, indices)

    def _pick(self, session_id: str | None) -> int:
        try:
            return self.router.pick(session_id)
        except NoServerLeftError:
            raise self._no_engine_left() from None

    # ---- calls on one engine, with failover -------------------------------------------------

    async def _on_one(
        self,
        call: Callable[[InferenceEngine], Awaitable[T]],
        weight: int,
        session_id: str | None = None,
        index: int | None = None,
    ) -> T:
        """`call` on engine `index` (default: the router's pick); an unavailable engine is taken
        out and the call retried on another."""
        index = self._pick(session_id) if index is None else index
        while True:
            self.router.acquire(index, weight)
            try:
                result = await call(self.engines[index])
            except EngineUnavailableError as exc:
                failed = index
                self.mark_failed(failed, exc)
            else:
                self.sequences_served[index] += weight
                return result
            finally:
                self.router.release(index, weight)  # the engine this attempt acquired
            index = self._pick(session_id)
            logger.warning(
                "retrying engine %d's request on engine %d (%r)", failed, index, self.engines[index]
            )

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None = None,
        **kwargs: Any,
    ) -> list[GenerateOutput]:
        """Prompts spread over the live engines by load (one engine for a session); `kwargs`
        (e.g. `prompt_logprobs=True`) go to each engine's `generate`; ``images`` (one list per
        prompt) go with their prompts."""
        if not prompts:
            return []
        images = kwargs.pop("images", None)

        def on(rows: list[int], sid: str | None) -> Callable[[InferenceEngine], Awaitable[Any]]:
            part = [prompts[i] for i in rows]
            if images is None:
                return lambda engine: engine.generate(part, params, sid, **kwargs)
            own = [images[i] for i in rows]
            return lambda engine: engine.generate(part, params, sid, images=own, **kwargs)

        weight = max(1, params.n)
        if session_id is not None or len(self.live_indices) <= 1:
            return await self._on_one(
                on(list(range(len(prompts))), session_id), weight * len(prompts), session_id
            )
        try:
            owners = self.router.assign([weight] * len(prompts))
        except NoServerLeftError:
            raise self._no_engine_left() from None
        by_engine: dict[int, list[int]] = {}
        for i, owner in enumerate(owners):
            by_engine.setdefault(owner, []).append(i)
        results: list[GenerateOutput | None] = [None] * len(prompts)

        async def run(index: int, rows: list[int]) -> None:
            outs = await self._on_one(on(rows, None), weight * len(rows), index=index)
            for row, out in zip(rows, outs, strict=True):
                results[row] = out

        await asyncio.gather(*(run(index, rows) for index, rows in by_engine.items()))
        return [r for r in results if r is not None]

    async def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced token logprobs (see `LocalVLLMEngine.prompt_logprobs`) from the
        least-loaded engine."""
        return await self._on_one(lambda e: e.prompt_logprobs(sequences), len(sequences))  # type: ignore[attr-defined]

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """vLLM's chat render route on the least-loaded engine (remote engines only)."""
        return await self._on_one(lambda e: e.render_chat_completion(payload), 1)  # type: ignore[attr-defined]

    # ---- calls on every engine --------------------------------------------------------------

    async def _every(
        self, method: str, *args: Any, strict: bool = False, only: Collection[int] | None = None
    ) -> list[Any]:
        """`method(*args)` on every live engine concurrently (`only`: of those indices), results in
        engine order.

        An unavailable engine is taken out; unless `strict` (weight sync: every engine must take
        part) the call succeeds while one engine (of `only`) is left. Any other failure is raised."""
        live = self._live(only)
        if not live:
            raise self._no_engine_left(only)
        results = await gather_all([getattr(self.engines[i], method)(*args) for i in live])
        for i, result in zip(live, results, strict=True):
            if isinstance(result, EngineUnavailableError):
                self.mark_failed(i, result)
        errors = [r for r in results if isinstance(r, BaseException)]
        other = [e for e in errors if not isinstance(e, EngineUnavailableError)]
        if other or (strict and errors):
            raise (other or errors)[0]
        if not self._live(only):
            raise self._no_engine_left(only)
        return [r for r in results if not isinstance(r, BaseException)]

    async def probe(self, timeout_s: float = 10.0, *, only: Collection[int] | None = None) -> list[int]:
        """Ask every live engine (`only`: of those indices) for its health; engines that fail or do
        not answer are taken out. Returns the indices still live (of `only`)."""

        async def one(i: int) -> None:
            try:
                healthy = await call_with_timeout(
                    repr(self.engines[i]), "health", self.engines[i].health(), timeout_s
                )
            except Exception as exc:  # noqa: BLE001 - any failure to answer is unhealthy
                self.mark_failed(i, f"health check failed: {exc!r}")
                return
            if not healthy:
                self.mark_failed(i, "health check answered unhealthy")

        await asyncio.gather(*(one(i) for i in self._live(only)))
        return self._live(only)

    async def sleep(self, level: int = 1) -> None:
        await self._every("sleep", level)

    async def wake_up(self) -> None:
        await self._every("wake_up")

    async def reset_prefix_cache(self) -> None:
        await self._every("reset_prefix_cache")

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        """Pause every live engine (for a weight update with requests in flight)."""
        await self._every("pause_generation", mode)

    async def resume_generation(self, policy_version: int | None = None) -> None:
        """Resume every live engine, labelling the tokens they sample from now on `policy_version`."""
        await self._every("resume_generation", policy_version)

    async def health(self) -> bool:
        return bool(self.live_indices) and all(await self._every("health"))

    # ---- weight sync: the live engines' workers as one target ------------------------------

    async def tensor_parallel_size(self) -> int:
        """Workers of all live engines (the ranks a weight-update group must make room for)."""
        return sum(await self._every("tensor_parallel_size", strict=True))

    async def weight_call(
        self,
        transport: str,
        operation: str,
        payload: dict[str, Any] | None = None,
        *,
        strict: bool = True,
        only: Collection[int] | None = None,
    ) -> list[Any]:
        """One weight-sync operation (`weight_sync.engine_side`) on every live engine concurrently
        (`only`: of those indices, the others never called); their answers in engine order.
        `strict` (a weight-update group's calls: every engine takes part in each broadcast): an
        unavailable engine fails the call; else it is taken out and the others go on (delta sync).
        A payload with a ``rank_offset`` (a group's join) is spread over the engines: engine i
        takes the ranks after engines 0..i-1 (of `only`)."""
        payload = payload or {}
        if "rank_offset" not in payload:
            return await self._every("weight_call", transport, operation, payload, strict=strict, only=only)
        sizes = await self._every("tensor_parallel_size", strict=True, only=only)
        live = self._live(only)
        if payload["rank_offset"] + sum(sizes) > payload.get("world_size", 0):
            raise ValueError(
                f"world_size={payload.get('world_size')} too small for {sum(sizes)} engine ranks from rank "
                f"{payload['rank_offset']} on {self!r}"
            )
        offsets = [payload["rank_offset"] + sum(sizes[:k]) for k in range(len(sizes))]
        engines: list[Any] = self.engines
        joins = [
            engines[i].weight_call(transport, operation, {**payload, "rank_offset": offset})
            for i, offset in zip(live, offsets, strict=True)
        ]
        results = await gather_all(joins)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return results

    async def close(self) -> None:
        """Close every engine, failed ones included (best effort for those)."""
        results = await gather_all([e.close() for e in self.engines])
        for i, result in enumerate(results):
            if isinstance(result, BaseException) and i not in self.failures:
                raise result


class EngineSubset:
    """Engines `indices` of `pool` (pool indices; in this view they are 0.. in that order)."""

    def __init__(self, pool: EnginePool, indices: Sequence[int]) -> None:
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"an engine subset names distinct engines, at least one: {list(indices)}")
        if not all(0 <= i < len(pool.engines) for i in indices):
            raise ValueError(f"engine indices {list(indices)} are not all in a pool of {len(pool.engines)}")
        self.pool, self.indices = pool, list(indices)
        self.engines = [pool.engines[i] for i in self.indices]

    def __repr__(self) -> str:
        return f"EngineSubset({self.indices} of {self.pool!r})"

    @property
    def live_indices(self) -> list[int]:
        """This view's indices (0..) of its engines still in the pool's service."""
        live = set(self.pool.live_indices)
        return [k for k, i in enumerate(self.indices) if i in live]

    async def probe(self, timeout_s: float = 10.0) -> list[int]:
        await self.pool.probe(timeout_s, only=self.indices)
        return self.live_indices

    async def weight_call(
        self, transport: str, operation: str, payload: dict[str, Any] | None = None, *, strict: bool = True
    ) -> list[Any]:
        """`EnginePool.weight_call` on this view's live engines only (a group's join spread over them)."""
        return await self.pool.weight_call(transport, operation, payload, strict=strict, only=self.indices)
