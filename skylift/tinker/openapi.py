"""The request bodies of the Tinker routes in the app's OpenAPI document, from the typed models
the routes parse them into (`skylift.tinker.core.bodies`: the SDK's request types with this server's
limits), so that clients and fuzzers (schemathesis) see what each route takes and what it
refuses. The routes read their bodies themselves (size limits, zstd), so FastAPI does not see
them; a typed body's dependency names its model (`body_model`, see `skylift.tinker.core.deps`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

#: routes whose body is a protobuf `ForwardBackwardRequest` (described as raw bytes)
PROTOBUF_ROUTES = ("/forward_backward", "/forward")
_REF = "#/components/schemas/{model}"


def _body_model(route: APIRoute) -> Any:
    for dep in route.dependant.dependencies:
        model = getattr(dep.call, "body_model", None)
        if model is not None:
            return model
    return None


def install_typed_bodies(app: FastAPI) -> None:
    """Describe the routes' bodies in `app.openapi()` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for route in app.routes:
            if not isinstance(route, APIRoute):
                continue
            for method in route.methods:
                op = doc["paths"].get(route.path_format, {}).get(method.lower())
                model = _body_model(route)
                if op is None:
                    continue
                if model is not None:
                    schema = model.model_json_schema(ref_template=_REF)
                    components.update(schema.pop("$defs", {}))
                    components[model.__name__] = schema
                    ref = {"$ref": _REF.format(model=model.__name__)}
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
                elif route.path_format.endswith(PROTOBUF_ROUTES):
                    binary = {"schema": {"type": "string", "format": "binary"}}
                    op["requestBody"] = {"required": True, "content": {"application/octet-stream": binary}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
