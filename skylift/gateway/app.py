"""The gateway's routes (FastAPI): ``/s/<session>/v1/models``, ``/s/<session>/v1/chat/completions``
and ``/s/<session>/v1/responses``.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 404 for a session
that is unknown or over, 400 for a request the gateway does not serve or a budget the call would
exceed (not 429: OpenAI clients retry that), 502 when the engines fail. With ``"stream": true``
the answer is sent as server-sent events (each API's own) once it is sampled.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from skylift.gateway.openai_format import RequestError, error_body, parse_chat_request, stream_events
from skylift.gateway.responses_format import parse_responses_request, response_events
from skylift.gateway.session import BudgetExceeded, Session

logger = logging.getLogger("skylift.gateway")


def gateway_app(gateway: Any) -> FastAPI:
    """The routes of `gateway` (a `skylift.gateway.server.Gateway`)."""
    app = FastAPI(title="skylift gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def session_of(session_id: str) -> Session | None:
        session = gateway.sessions.get(session_id)
        return None if session is None or session.closed else session

    def unknown() -> JSONResponse:
        return JSONResponse(error_body("unknown or finished gateway session", "not_found_error"), 404)

    @app.get("/s/{session_id}/v1/models")
    async def models(session_id: str) -> Any:
        if session_of(session_id) is None:
            return unknown()
        entry = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "skylift"}
        return {"object": "list", "data": [entry]}

    async def served(session_id: str, request: Request, call: Any) -> Any:
        """`call(session, body)` answered, or the error a client gets for it."""
        session = session_of(session_id)
        if session is None:
            return unknown()
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse(error_body(f"the body is not JSON: {exc}", "invalid_request_error"), 400)
        try:
            return await call(session, body)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error", exc.param), 400)
        except BudgetExceeded as exc:
            return JSONResponse(error_body(str(exc), "budget_exceeded", code="budget_exceeded"), 400)
        except Exception as exc:  # noqa: BLE001 - the engine's failure is the agent's error, not a crash
            logger.warning("gateway call failed: %s: %s", type(exc).__name__, exc)
            return JSONResponse(
                error_body(f"sampling failed: {type(exc).__name__}: {exc}", "server_error"), 502
            )

    def events(lines: list[str]) -> StreamingResponse:
        async def send() -> Any:
            for line in lines:
                yield line

        return StreamingResponse(send(), media_type="text/event-stream")

    async def chat(session: Session, body: Any) -> Any:
        request = parse_chat_request(body)
        answer = await gateway.complete(session, request)
        return events(stream_events(answer, request.include_usage)) if request.stream else answer

    async def respond(session: Session, body: Any) -> Any:
        request = parse_responses_request(body, session.responses)
        answer = await gateway.respond(session, request)
        return events(response_events(answer)) if request.stream else answer

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Any:
        return await served(session_id, request, chat)

    @app.post("/s/{session_id}/v1/responses")
    async def responses(session_id: str, request: Request) -> Any:
        return await served(session_id, request, respond)

    @app.api_route("/s/{session_id}/v1/{rest:path}", methods=["GET", "POST"])
    async def other(session_id: str, rest: str) -> Any:
        if session_of(session_id) is None:
            return unknown()
        return JSONResponse(
            error_body(
                f"/v1/{rest} is not served by skylift's gateway (chat/completions, responses, models)",
                "not_found_error",
            ),
            404,
        )

    return app
