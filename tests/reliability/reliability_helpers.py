"""HTTP helpers of the reliability tests: one client per server under test, error messages, futures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

#: Seconds one request may take before the test calls it a hang.
REQUEST_TIMEOUT_S = 60.0
#: The Tinker server's API key (the SDK wants keys that start with `tml-`).
TINKER_API_KEY = "tml-reliability-key"


@dataclass(frozen=True)
class TinkerModel:
    """A session and a LoRA training model on the Tinker server."""

    session_id: str
    model_id: str


@dataclass
class Api:
    """A server under test: base URL plus the headers that authenticate to it."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """One request; `body` bytes go as they are (with `content_type`), anything else as JSON."""
        sent = {**(self.headers if authenticate else {}), **(headers or {})}
        kwargs: dict[str, Any] = {}
        if isinstance(body, bytes):
            kwargs["content"] = body
            sent["Content-Type"] = content_type or "application/octet-stream"
        elif body is not None:
            kwargs["json"] = body
            if content_type:
                sent["Content-Type"] = content_type
        return httpx.request(method, self.url + path, headers=sent, timeout=REQUEST_TIMEOUT_S, **kwargs)


def error_message(resp: httpx.Response) -> str:
    """The error text of a response in any of the servers' formats (vLLM, skylift, Tinker, FastAPI)."""
    try:
        payload = resp.json()
    except ValueError:
        return resp.text
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "detail" in payload:
            return str(payload["detail"])
    return resp.text


def tinker_result(tinker: Api, request_id: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """The finished future `request_id` (a failure is `{"error", "category"}`); AssertionError on a hang."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = tinker.request("POST", "/api/v1/retrieve_future", {"request_id": request_id})
        if resp.status_code != 408:
            assert resp.status_code == 200, (resp.status_code, resp.text)
            if resp.headers.get("content-type", "").startswith("application/json"):
                return resp.json()
            return {"protobuf": resp.content}
    raise AssertionError(f"future {request_id} did not finish in {timeout_s:.0f} s")
