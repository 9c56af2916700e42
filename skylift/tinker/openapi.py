"""The request bodies of the Tinker routes in the app's OpenAPI document, from the SDK's own
request types (`tinker.types`), so that clients and fuzzers (schemathesis) see what each route
takes. Bodies are still read by the routes themselves (`skylift.tinker.http_common.read_json`);
this module only describes them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

#: route (under the API prefix) -> the SDK's request type of its JSON body
SDK_BODIES = {
    "client/config": "ClientConfigRequest",
    "telemetry": "TelemetrySendRequest",
    "create_session": "CreateSessionRequest",
    "session_heartbeat": "SessionHeartbeatRequest",
    "create_model": "CreateModelRequest",
    "get_info": "GetInfoRequest",
    "optim_step": "OptimStepRequest",
    "save_weights": "SaveWeightsRequest",
    "save_weights_for_sampler": "SaveWeightsForSamplerRequest",
    "save_weights_external": "SaveWeightsExternalRequest",
    "load_weights": "LoadWeightsRequest",
    "create_sampling_session": "CreateSamplingSessionRequest",
    "asample": "SampleRequest",
    "retrieve_future": "FutureRetrieveRequest",
    "copy_weights": "CopyWeightsRequest",
}
#: routes whose body is a protobuf `ForwardBackwardRequest` (described as raw bytes)
PROTOBUF_ROUTES = ("forward_backward", "forward")
_REF = "#/components/schemas/{model}"


def _sdk_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """(route -> body schema reference, every schema they refer to)."""
    import tinker.types as sdk

    refs: dict[str, Any] = {}
    components: dict[str, Any] = {}
    for route, name in SDK_BODIES.items():
        schema = getattr(sdk, name).model_json_schema(ref_template=_REF)
        components.update(schema.pop("$defs", {}))
        components[name] = schema
        refs[route] = {"$ref": _REF.format(model=name)}
    return refs, components


def install_sdk_bodies(app: FastAPI, api: str) -> None:
    """Describe the Tinker routes' bodies in `app.openapi()` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, components = _sdk_schemas()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
        for route, ref in refs.items():
            post = doc["paths"].get(f"{api}/{route}", {}).get("post")
            if post is not None:
                post["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
        for route in PROTOBUF_ROUTES:
            post = doc["paths"].get(f"{api}/{route}", {}).get("post")
            if post is not None:
                binary = {"schema": {"type": "string", "format": "binary"}}
                post["requestBody"] = {"required": True, "content": {"application/octet-stream": binary}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
