"""What other projects' clients and commands need of `skylift serve`, added by plugins.

`ROUTES` holds installers (``install(app)``) that `skylift.inference.routes.install_routes` calls
after mounting skylift's own routes; `WEIGHT_TRANSFER` the handler of ``POST /update_weights``
bodies that carry ``update_info`` (vLLM's weight-transfer protocol) instead of a bucket;
`WORKER_EXTENSIONS` functions that say why a ``--worker-extension-cls`` another project's server
command names is replaced by skylift's receiver (None: not theirs;
`skylift.inference.engine_args.worker_extension`). The built-in plugin (vLLM's RL control and
weight-transfer routes, SkyRL's receiver) is named here and imported by name on first use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from skylift.utils.hooks import Hook

_BUILTIN_MODULES = ("skylift.compat.skyrl.routes",)

ROUTES: Hook[Callable[[FastAPI], None]] = Hook("route plugin", _BUILTIN_MODULES)
WEIGHT_TRANSFER: Hook[Callable[[Request, dict[str, Any]], Awaitable[dict[str, Any]]]] = Hook(
    "weight-transfer update handler", _BUILTIN_MODULES
)
WORKER_EXTENSIONS: Hook[Callable[[str], str | None]] = Hook("worker extension replacement", _BUILTIN_MODULES)


def install_plugin_routes(app: FastAPI) -> None:
    """Mount every plugin's routes on `app`."""
    for install in ROUTES.items():
        install(app)


async def weight_transfer_update(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /update_weights`` with ``update_info``: the registered handler's answer (501 when none)."""
    handlers = WEIGHT_TRANSFER.items()
    if not handlers:
        raise HTTPException(
            int(HTTPStatus.NOT_IMPLEMENTED), "/update_weights with update_info: no weight-transfer handler"
        )
    return await handlers[-1](request, body)
