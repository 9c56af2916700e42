"""Models an environment may call while it scores (an LLM judge, a user simulator).

An environment reaches a model through ``self.llm``, an `LLMClient` the generator sets before
``init``: `OpenAIChatClient` when ``environment.llm_base_url`` names an OpenAI-compatible server,
else a client of the policy's own engines (`skylift.generator.llm.EngineChatClient`). Calls are
coroutines: an ``async def step`` awaits them while the other trajectories keep generating.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

import aiohttp

#: Sampling fields a caller may pass to `OpenAIChatClient.chat` (the rest of the body is ours).
CHAT_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop")


class LLMCallError(RuntimeError):
    """A model call failed: the server answered an error, malformed JSON, or not in time."""


@runtime_checkable
class LLMClient(Protocol):
    """A chat model: messages in, the assistant's reply text out."""

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> str: ...


class OpenAIChatClient:
    """`LLMClient` over HTTP to an OpenAI-compatible ``/chat/completions`` endpoint.

    `base_url` is the API root as OpenAI clients take it (``http://127.0.0.1:8000/v1``); every
    request has a total timeout of `timeout_s`, and at most `max_concurrency` run at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 60.0,
        max_concurrency: int = 16,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"llm base URL must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(
                f"need timeout_s > 0 and max_concurrency >= 1, got {timeout_s}, {max_concurrency}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # one session and limit per event loop (a generator may be driven by several asyncio.run)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._limit: asyncio.Semaphore | None = None

    def _session_for_loop(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._limit is None or self._loop is not loop or self._session.closed:
            self._loop = loop
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._limit = asyncio.Semaphore(self.max_concurrency)
        return self._session, self._limit

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> str:
        unknown = sorted(set(sampling) - set(CHAT_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; accepted: {list(CHAT_SAMPLING_KEYS)}")
        body = {"model": self.model, "messages": messages, **sampling}
        session, limit = self._session_for_loop()
        async with limit:
            try:
                async with session.post(self.url, json=body, headers=self._headers) as response:
                    text = await response.text()
                    if response.status != 200:
                        raise LLMCallError(f"{self.url} answered HTTP {response.status}: {text[:300]}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise LLMCallError(f"{self.url} failed: {type(exc).__name__}: {exc}") from exc
        return _reply_text(self.url, text)

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def _reply_text(url: str, body: str) -> str:
    import json

    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise LLMCallError(f"{url} answered no choices[0].message.content: {body[:300]}") from exc
    if not isinstance(content, str):
        raise LLMCallError(f"{url} answered a non-text message content: {content!r}")
    return content
