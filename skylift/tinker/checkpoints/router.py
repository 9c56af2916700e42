"""HTTP routes of checkpoints out and in (see `skylift.tinker.checkpoints.operations`), with
the same ownership checks as the other routes: only the owner changes a checkpoint; reading needs
the owner or a published checkpoint; a signed download URL is its own credential."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from skylift.tinker.checkpoints.bodies import (
    CopyWeightsBody,
    SaveWeightsExternalBody,
    TtlBody,
    WeightsInfoBody,
)
from skylift.tinker.checkpoints.operations import SIGNED_PREFIX, CheckpointOperations
from skylift.tinker.core import ownership
from skylift.tinker.core.deps import (
    Caller,
    IdemKey,
    OwnersDep,
    app_part,
    model_op,
    model_refusal,
    operation,
    typed,
)
from skylift.tinker.core.http_common import error_response as _error
from skylift.tinker.core.ownership import Owners

router = APIRouter()  # under the API prefix
signed = APIRouter()  # at the root: signed download URLs

Checkpoints = Annotated[CheckpointOperations, app_part("checkpoints")]
CKPT = "/training_runs/{run_id}/checkpoints/{segment}/{name}"


@router.post("/save_weights_external")
async def save_weights_external(
    request: Request,
    checkpoints: Checkpoints,
    owners: OwnersDep,
    key: IdemKey,
    body: Annotated[SaveWeightsExternalBody, model_op(SaveWeightsExternalBody, "save_weights_external")],
) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        request_id = await checkpoints.save_weights_external(body, key)
        return {"request_id": request_id, "model_id": body.model_id}

    return await operation(request, "save_weights_external", model_refusal(owners, body.model_id), run)


def _owned(owners: Owners, user: str, run_id: str, segment: str, name: str, write: bool) -> None:
    path = f"tinker://{run_id}/{segment}/{name}"
    allowed = owners.may_write_path if write else owners.may_read_path
    if not allowed(user, path):
        raise ownership.missing_checkpoint(path)


@router.get(f"{CKPT}/external_weights_urls")
async def external_weights_urls(
    run_id: str,
    segment: str,
    name: str,
    request: Request,
    checkpoints: Checkpoints,
    owners: OwnersDep,
    user: Caller,
) -> dict[str, Any]:
    def urls() -> dict[str, Any]:
        _owned(owners, user, run_id, segment, name, write=False)
        return checkpoints.external_weights_urls(run_id, f"{segment}/{name}", str(request.base_url))

    return await asyncio.to_thread(urls)


@signed.get(SIGNED_PREFIX + "/{rest:path}")
async def signed_download(
    rest: str, request: Request, checkpoints: Checkpoints, expires: int = Query(...), sig: str = Query(...)
) -> Response:
    """A file of an external weights checkpoint; the URL's signature is the credential."""
    try:
        target = await asyncio.to_thread(checkpoints.signed_file, request.url.path, expires, sig)
    except PermissionError as exc:
        return _error(403, str(exc))
    return FileResponse(target)


async def _change(
    owners: Owners, user: str, run_id: str, segment: str, name: str, change: Callable[[], None]
) -> Response:
    def run() -> None:
        _owned(owners, user, run_id, segment, name, write=True)
        change()

    await asyncio.to_thread(run)
    return Response(status_code=204)


@router.post(f"{CKPT}/publish")
async def publish(
    run_id: str, segment: str, name: str, checkpoints: Checkpoints, owners: OwnersDep, user: Caller
) -> Response:
    change = lambda: checkpoints.set_public(run_id, f"{segment}/{name}", True)  # noqa: E731
    return await _change(owners, user, run_id, segment, name, change)


@router.delete(f"{CKPT}/publish")
async def unpublish(
    run_id: str, segment: str, name: str, checkpoints: Checkpoints, owners: OwnersDep, user: Caller
) -> Response:
    change = lambda: checkpoints.set_public(run_id, f"{segment}/{name}", False)  # noqa: E731
    return await _change(owners, user, run_id, segment, name, change)


@router.put(f"{CKPT}/ttl")
async def set_ttl(
    run_id: str,
    segment: str,
    name: str,
    checkpoints: Checkpoints,
    owners: OwnersDep,
    user: Caller,
    body: Annotated[TtlBody, typed(TtlBody)],
) -> Response:
    change = lambda: checkpoints.set_ttl(run_id, f"{segment}/{name}", body.ttl_seconds)  # noqa: E731
    return await _change(owners, user, run_id, segment, name, change)


@router.post("/weights_info")
async def weights_info(
    checkpoints: Checkpoints,
    owners: OwnersDep,
    user: Caller,
    body: Annotated[WeightsInfoBody, typed(WeightsInfoBody)],
) -> dict[str, Any]:
    def info() -> dict[str, Any]:
        if not owners.may_read_path(user, body.tinker_path):
            raise ownership.missing_checkpoint(body.tinker_path)
        return checkpoints.weights_info(body.tinker_path)

    return await asyncio.to_thread(info)


@router.post("/copy_weights")
async def copy_weights(
    checkpoints: Checkpoints,
    owners: OwnersDep,
    user: Caller,
    body: Annotated[CopyWeightsBody, typed(CopyWeightsBody)],
) -> dict[str, Any]:
    def copy() -> dict[str, Any]:
        if not owners.may_read_path(user, body.source_path):
            raise ownership.missing_checkpoint(body.source_path)
        if body.session_id is not None:
            owners.session(user, body.session_id)
        return checkpoints.copy_weights(body, user)

    return await asyncio.to_thread(copy)
