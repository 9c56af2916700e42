"""HTTP routes of checkpoints out and in (see `skylift.tinker.checkpoints`) and of sessions, with
the same ownership checks as the other routes: only the owner changes a checkpoint; reading needs
the owner or a published checkpoint; a signed download URL is its own credential."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, Response

from skylift.tinker import checkpoints, ownership
from skylift.tinker.http_common import add_owned_route, add_page_route
from skylift.tinker.http_common import error_response as _error
from skylift.tinker.http_common import read_json as _json
from skylift.tinker.ownership import Owners
from skylift.tinker.service import TinkerService

Refusal = Callable[[str], Exception | None]


def add_routes(
    app: FastAPI,
    api: str,
    service: TinkerService,
    owners: Owners,
    who: Callable[[Request], str],
    idem: Callable[[Request], str | None],
    operation: Callable[..., Awaitable[dict[str, Any]]],
    model_refusal: Callable[[object], Refusal],
) -> None:
    """Register the routes on `app` (the helpers are the app's own: caller, idempotency key,
    operation submission and the unknown-model refusal)."""

    @app.post(f"{api}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        body = await _json(request)

        async def run() -> dict[str, Any]:
            request_id = await checkpoints.save_weights_external(service, body, idem(request))
            return {"request_id": request_id, "model_id": body.get("model_id")}

        return await operation(request, "save_weights_external", model_refusal(body.get("model_id")), run)

    ckpt = f"{api}/training_runs/{{run_id}}/checkpoints/{{segment}}/{{name}}"

    def owned_checkpoint(request: Request, run_id: str, segment: str, name: str, write: bool) -> None:
        path = f"tinker://{run_id}/{segment}/{name}"
        allowed = owners.may_write_path if write else owners.may_read_path
        if not allowed(who(request), path):
            raise ownership.missing_checkpoint(path)

    @app.get(f"{ckpt}/external_weights_urls")
    async def external_weights_urls(run_id: str, segment: str, name: str, request: Request) -> dict[str, Any]:
        def urls() -> dict[str, Any]:
            owned_checkpoint(request, run_id, segment, name, write=False)
            return checkpoints.external_weights_urls(
                service, run_id, f"{segment}/{name}", str(request.base_url)
            )

        return await asyncio.to_thread(urls)

    @app.get(checkpoints.SIGNED_PREFIX + "/{rest:path}")
    async def signed_download(
        rest: str, request: Request, expires: int = Query(...), sig: str = Query(...)
    ) -> Response:
        """A file of an external weights checkpoint; the URL's signature is the credential."""
        try:
            target = await asyncio.to_thread(checkpoints.signed_file, service, request.url.path, expires, sig)
        except PermissionError as exc:
            return _error(403, str(exc))
        return FileResponse(target)

    async def checkpoint_change(
        request: Request, run_id: str, segment: str, name: str, change: Any
    ) -> Response:
        def run() -> None:
            owned_checkpoint(request, run_id, segment, name, write=True)
            change()

        await asyncio.to_thread(run)
        return Response(status_code=204)

    @app.post(f"{ckpt}/publish")
    async def publish(run_id: str, segment: str, name: str, request: Request) -> Response:
        change = lambda: checkpoints.set_public(service, run_id, f"{segment}/{name}", True)  # noqa: E731
        return await checkpoint_change(request, run_id, segment, name, change)

    @app.delete(f"{ckpt}/publish")
    async def unpublish(run_id: str, segment: str, name: str, request: Request) -> Response:
        change = lambda: checkpoints.set_public(service, run_id, f"{segment}/{name}", False)  # noqa: E731
        return await checkpoint_change(request, run_id, segment, name, change)

    @app.put(f"{ckpt}/ttl")
    async def set_ttl(run_id: str, segment: str, name: str, request: Request) -> Response:
        body = await _json(request)
        change = lambda: checkpoints.set_ttl(service, run_id, f"{segment}/{name}", body)  # noqa: E731
        return await checkpoint_change(request, run_id, segment, name, change)

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        path = str((await _json(request)).get("tinker_path"))

        def info() -> dict[str, Any]:
            if not owners.may_read_path(who(request), path):
                raise ownership.missing_checkpoint(path)
            return checkpoints.weights_info(service, path)

        return await asyncio.to_thread(info)

    @app.post(f"{api}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def copy() -> dict[str, Any]:
            user, source = who(request), body.get("source_path")
            if not owners.may_read_path(user, source):
                raise ownership.missing_checkpoint(source)
            if body.get("session_id") is not None:
                owners.session(user, body["session_id"])
            return checkpoints.copy_weights(service, body, user)

        return await asyncio.to_thread(copy)

    add_page_route(app, f"{api}/sessions", partial(checkpoints.list_sessions, service))
    add_owned_route(app, f"{api}/sessions/{{key}}", owners.session, partial(checkpoints.get_session, service))
