"""The server's LoRA routes (shims onto the LoRA transport's engine half,
`weight_sync.lora.engine`), with vLLM's semantics (start the server with --enable-lora
--max-lora-rank N; without, these answer 409):

- POST `/v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"?}`: load (or with
  `load_inplace`, replace) the PEFT adapter in the directory `lora_path` on the server's host.
  400: a name or path missing, a name already loaded (without `load_inplace`) or the served
  model's; 404: no adapter at that path; 400: one vLLM cannot load (e.g. a rank above
  --max-lora-rank). skylift's `activate: true` also makes it the default of `/skylift/generate`;
- POST `/v1/unload_lora_adapter` `{"lora_name"}`: 400 without a name, 404 for an unknown one;
- POST `/skylift/receive_lora_adapter`: the in-memory LoRA sync (`skylift.weight_sync.lora.adapter`): the
  adapter's bucket metadata, its `name` and `peft_config`, and the adapters it supersedes
  (`retire`, unloaded in the same engine call); the tensors arrive over the weight-update group
  while the request is open.

Generation names an adapter as vLLM does: OpenAI `model` = the adapter's name on /v1/completions
and /v1/chat/completions (the adapters live in vLLM's own table, listed by /v1/models), or
`lora_name` on `/skylift/generate`. Success answers are vLLM's plain-text messages.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse

from skylift.inference.bodies import LoadLoraAdapterBody, ReceiveLoraAdapterBody, UnloadLoraAdapterBody
from skylift.inference.engine_http import engine_call
from skylift.inference.routes import SkyliftState

router = APIRouter()


def _state(request: Request) -> SkyliftState:
    return request.app.state.skylift


def _is_base_model(request: Request, name: str) -> bool:
    if name == _state(request).model_name:
        return True
    models = getattr(request.app.state, "openai_serving_models", None)
    return bool(models is not None and models.is_base_model(name))


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterBody, request: Request) -> str:
    """Load or replace a LoRA adapter from a directory on this host."""
    if body.lora_name and _is_base_model(request, body.lora_name):
        raise HTTPException(
            int(HTTPStatus.BAD_REQUEST),
            f"The lora adapter '{body.lora_name}' conflicts with a served base model.",
        )
    engine = _state(request).engine
    await engine_call(engine.weight_call("lora", "load", body.model_dump()))
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterBody, request: Request) -> str:
    """Unload a LoRA adapter by name."""
    await engine_call(_state(request).engine.weight_call("lora", "unload", {"lora_name": body.lora_name}))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


@router.post("/skylift/receive_lora_adapter")
async def receive_lora_adapter(body: ReceiveLoraAdapterBody, request: Request) -> dict[str, object]:
    """Receive a LoRA adapter over the weight-update group (the trainer broadcasts meanwhile)."""
    engine = _state(request).engine
    await engine_call(engine.weight_call("lora", "receive", body.model_dump()))
    return {"status": "ok", "lora_name": body.name, "default": engine.lora.default}


def install(app: FastAPI) -> None:
    """Attach these routes ahead of vLLM's own (it mounts its LoRA routes with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."""
    before = len(app.router.routes)
    app.include_router(router)
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = ours
