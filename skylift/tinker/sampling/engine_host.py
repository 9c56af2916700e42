"""Lazily started inference engines for sampling, one per base model, reused by every sampler.

Nothing here starts at import or at server start. The first `sample` (or a `prefetch`, which an
ephemeral `save_weights_for_sampler` requests) starts the vLLM engine on a dedicated event-loop thread (its
start-up blocks only that thread) and opens a weight transport to it. The engine holds one
set of full weights at a time, named by a *tag* ("base", a sampler checkpoint path, or an
ephemeral sampling session): a request for other full weights waits until running generations
finish, pushes the new weights (`skylift.weight_sync.factory.local_tensors_transport`: shared
memory on one host) and proceeds. LoRA samplers of the
base model are served as adapters in the batch instead where the engine's mode says so
(`skylift.tinker.sampling.lora_mode`): every request carries its adapter, loaded into one of the engine's
slots (`skylift.tinker.sampling.adapter_slots`), and nothing waits for other users' generations.
A request's engine parameters and its result: `skylift.tinker.sampling.sample_io`.

Set ``SKYLIFT_TINKER_FAIL_ENGINE_START=1`` to make every start-up attempt raise (tests use it to
show that training never needs an engine).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

from skylift.config.services import EngineSettings
from skylift.inference.types import EngineError, SamplingParams
from skylift.inference.vllm_patches.lora_prompt_logprobs import adapter_may_score_prompts
from skylift.tinker.core.images import ImageInput
from skylift.tinker.sampling.adapter_slots import AdapterSlots
from skylift.tinker.sampling.lora_mode import ModeChoice, accepts_unembed, calibrate
from skylift.tinker.sampling.sample_io import PromptScores, SampleResult, image_result, text_result
from skylift.tinker.sampling.weights import SamplerWeights, load_safetensors_dir, merged_folder_into_base
from skylift.utils.affinity import bind_this_thread
from skylift.utils.loop_thread import LoopThread

logger = logging.getLogger(__name__)

T = TypeVar("T")
FAIL_START_ENV = "SKYLIFT_TINKER_FAIL_ENGINE_START"


async def _none() -> None:
    return None


class EngineHost:
    """One base model's engine, started on first use, living on its own event-loop thread.

    For a vision-language model it also serves the chat render route in-process
    (`render_chat_completion`, the `RenderClient` protocol) and samples from prompts with images.
    `on_started` callbacks run on the engine loop right after a start-up.
    """

    def __init__(
        self,
        base_model: str,
        model_path: str,
        settings: EngineSettings,
        vision: bool = False,
        cpus: Sequence[int] | None = None,
        fixed_swap: str | None = None,
    ) -> None:
        self.base_model = base_model
        self.model_path = model_path
        self.settings = settings
        self.vision = vision
        #: why LoRA samplers take weight swaps whatever the flag says (`lora_mode.fixed_swap`:
        #: a vision-language or mixture-of-experts base); None: the flag decides
        self.fixed_swap = fixed_swap
        self.cpus = cpus  # the cores the engine's compute threads bind to (None: every core)
        self.on_started: list[Callable[[EngineHost], Awaitable[None]]] = []
        self._renderer: Any = None
        self.start_attempts = 0
        self.last_error: str | None = None
        self._engine: Any = None
        self._transport: Any = None  # a TensorsTransport opened for the engine
        self._tag: str | None = None
        self._pushes = 0  # the version number of the transport's last push
        #: how LoRA samplers are served (decided once, at the first start-up) and the adapter slots
        self.lora_mode: ModeChoice | None = None
        self.slots: AdapterSlots | None = None
        #: requests of samplers served in the batch that scored their prompt on swapped-in weights
        self.prompt_scoring_swaps = 0
        self._active = 0
        self._loop_thread: LoopThread | None = None  # the engine's own loop, made on first use
        self._thread_lock = threading.Lock()
        self._start_lock: asyncio.Lock | None = None
        self._cond: asyncio.Condition | None = None

    @property
    def started(self) -> bool:
        return self._engine is not None

    # ---------------------------------------------------------------- thread plumbing
    def _ensure_loop(self) -> LoopThread:
        with self._thread_lock:
            if self._loop_thread is None:
                self._loop_thread = LoopThread(
                    name=f"tinker-engine-{self.base_model}", on_start=self._bind_cores
                )
            return self._loop_thread

    def _bind_cores(self) -> None:
        """The engine's thread, before its loop runs: on the engine's cores where it has its own (its
        scheduler process, started from here, inherits them; the rest of the server keeps the others)."""
        if self.cpus:
            bind_this_thread(self.cpus)

    async def _on_engine_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self._ensure_loop().submit(coro))

    # ---------------------------------------------------------------- engine loop side
    async def _ensure_started(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
            self._cond = asyncio.Condition()
        async with self._start_lock:
            if self._engine is not None:
                return
            self.start_attempts += 1
            try:
                if os.environ.get(FAIL_START_ENV) == "1":
                    raise EngineError(f"engine start-up refused: {FAIL_START_ENV}=1 is set (test hook)")
                from skylift.inference.local import LocalVLLMEngine
                from skylift.weight_sync.factory import local_tensors_transport

                s = self.settings
                extra: dict[str, Any] = {}
                if self.vision:
                    from skylift.inference.engine_args import VISION_ENGINE_ARGS
                    from skylift.tinker.vision.render_server import enable_vision_compat

                    enable_vision_compat()
                    extra = dict(VISION_ENGINE_ARGS)
                extra.update(self._lora_args())
                if s.gpu_memory_utilization is not None:  # what the server's training budget leaves
                    extra["gpu_memory_utilization"] = s.gpu_memory_utilization
                engine = await LocalVLLMEngine.create(
                    self.model_path,
                    max_model_len=s.max_model_len,
                    seed=s.seed,
                    dtype=s.dtype,
                    max_num_seqs=s.max_num_seqs,
                    enable_prefix_caching=True,
                    name=f"tinker-sampler({self.base_model})",
                    cpus=self.cpus,
                    **extra,
                )
                transport = local_tensors_transport([engine])
                try:
                    await transport.open()
                except Exception:
                    await engine.close()
                    raise
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.error("inference engine for %s failed to start: %s", self.base_model, exc)
                raise EngineError(f"inference engine for {self.base_model!r} failed to start: {exc}") from exc
            self._engine, self._transport, self._tag = engine, transport, "base"
            self.last_error = None
            logger.info("inference engine for %s started (attempt %d)", self.base_model, self.start_attempts)
            await self._choose_lora_mode(engine, transport)
            # the engine's client, its tokenizer and vLLM's modules live as long as the server: out of
            # the garbage collector's full passes, which would otherwise stop every thread for them
            gc.freeze()
            if self.vision:
                from skylift.tinker.vision.engine_render import EngineRenderer

                self._renderer = EngineRenderer(engine.vllm_engine, self.model_path)
            for callback in self.on_started:
                try:
                    await callback(self)
                except Exception:
                    logger.exception("engine start-up callback failed")

    def _lora_args(self) -> dict[str, Any]:
        """vLLM's LoRA arguments where LoRA samplers may be served as adapters."""
        s = self.settings
        if s.lora_mode == "swap" or self.fixed_swap or (self.lora_mode and self.lora_mode.mode == "swap"):
            return {}
        from skylift.weight_sync.lora.adapter import vllm_max_lora_rank

        return {
            "enable_lora": True,
            "max_lora_rank": vllm_max_lora_rank(s.max_lora_rank),
            "max_loras": min(s.max_loras, s.lora_slots),
            "max_cpu_loras": s.lora_slots,
        }

    async def _choose_lora_mode(self, engine: Any, transport: Any) -> None:
        """Adapters in the batch or weight swaps (`skylift.tinker.sampling.lora_mode`), once per host."""
        if self.lora_mode is None:
            self.lora_mode = await self._measure_lora_mode(engine, transport)
            logger.info(
                "sampling engine for %s serves LoRA samplers by %s: %s%s",
                self.base_model,
                "adapters in the batch" if self.lora_mode.mode == "adapters" else "weight swaps",
                self.lora_mode.reason,
                "" if self.lora_mode.mode == "swap" or self.lora_mode.unembed
                else "; adapters of the unembedding (train_unembed) swap weights: this model takes none",
            )  # fmt: skip
        if self.lora_mode.mode == "adapters" and engine.lora.enabled:
            self.slots = AdapterSlots(
                engine, self.settings.lora_slots, f"sampling engine of {self.base_model}"
            )

    async def _measure_lora_mode(self, engine: Any, transport: Any) -> ModeChoice:
        if not engine.lora.enabled:
            return ModeChoice("swap", self.fixed_swap or "--sampler-lora swap")
        unembed = accepts_unembed(engine)
        if self.settings.lora_mode == "adapters":
            return ModeChoice("adapters", "--sampler-lora adapters", unembed)
        weights = await asyncio.to_thread(load_safetensors_dir, self.model_path)
        try:
            width = min(self.settings.max_loras, self.settings.lora_slots)  # what one batch mixes
            swap = partial(merged_folder_into_base, self.model_path)  # what a LoRA sampler's swap pushes
            return await calibrate(
                engine, transport, weights, self.settings.max_lora_rank, unembed, width, swap
            )
        except Exception as exc:  # the engine serves on: LoRA samplers swap weights
            logger.warning("LoRA calibration of the %s engine failed: %s", self.base_model, exc)
            return ModeChoice("swap", f"the calibration failed: {exc}")
        finally:
            del weights

    def serves_adapter(self, weights: SamplerWeights, scores_prompt: bool = False) -> bool:
        """Whether `weights` are served as an adapter in the batch (else: a weight swap) for a
        request that does (`scores_prompt`) or does not score its prompt: vLLM 0.32 scores prompt
        tokens wrongly under an adapter of the unembedding (`vllm_patches.lora_prompt_logprobs`)."""
        adapter, mode = weights.adapter, self.lora_mode
        if self.slots is None or adapter is None or mode is None:
            return False
        if scores_prompt and not adapter_may_score_prompts(adapter.unembed):
            return False
        return adapter.rank <= self.settings.max_lora_rank and (mode.unembed or not adapter.unembed)

    async def _acquire(self, weights: SamplerWeights, scores_prompt: bool = False) -> str:
        """Make `weights` current (full weights swapped in, or the base under an adapter) and
        count one active user; returns the adapter name to sample with ("": none)."""
        await self._ensure_started()
        cond = self._cond
        assert cond is not None
        as_adapter = self.serves_adapter(weights, scores_prompt)
        if scores_prompt and not as_adapter and self.serves_adapter(weights):
            self.prompt_scoring_swaps += 1  # served in the batch but for this request
        tag = "base" if as_adapter else weights.tag
        async with cond:
            while self._tag != tag and self._active > 0:
                await cond.wait()
            if self._tag != tag:
                full = (
                    weights.load_full if not as_adapter else (lambda: load_safetensors_dir(self.model_path))
                )
                self._transport.put(await asyncio.to_thread(full))
                self._pushes += 1
                await self._transport.push(self._pushes)
                self._tag = tag
            self._active += 1
        if not as_adapter:
            return ""
        assert self.slots is not None and weights.adapter is not None
        try:
            return await self.slots.acquire(weights.tag, weights.adapter)
        except BaseException:
            await self._release("")
            raise

    async def _release(self, lora_name: str) -> None:
        if lora_name and self.slots is not None:
            await self.slots.release(lora_name)
        assert self._cond is not None
        async with self._cond:
            self._active -= 1
            self._cond.notify_all()

    async def _sample(
        self, weights: SamplerWeights, prompt: list[int], params: SamplingParams, scores: PromptScores
    ) -> SampleResult:
        want_plp = scores.logprobs and len(prompt) > 1
        want_topk = bool(scores.topk) and len(prompt) > 1
        targets = scores.target_sequences(prompt)
        lora = await self._acquire(weights, scores_prompt=want_plp or want_topk or bool(targets))
        engine = self._engine
        try:
            results = await asyncio.gather(
                engine.generate([prompt], params, lora_name=lora),
                engine.prompt_logprobs([prompt], lora_name=lora) if want_plp else _none(),
                engine.prompt_top_logprobs(prompt, scores.topk, lora_name=lora) if want_topk else _none(),
                engine.prompt_logprobs([seq for _, _, seq in targets], lora_name=lora)
                if targets
                else _none(),
            )
        finally:
            await self._release(lora)
        return text_result(results, scores, targets)

    async def _sample_images(
        self, weights: SamplerWeights, parts: Sequence[list[int] | ImageInput], params: SamplingParams
    ) -> SampleResult:
        from skylift.tinker.vision.engine_render import collapse_images, generate_multimodal

        image_token_id = self._engine.vllm_engine.model_config.hf_config.image_token_id
        prompt, images = collapse_images(parts, image_token_id)
        lora = await self._acquire(weights)  # a vision engine has no adapters: ""
        try:
            output = await generate_multimodal(self._engine, prompt, images, params)
        finally:
            await self._release(lora)
        return image_result(output)

    async def _render(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self._renderer is None:
            raise EngineError(f"the engine for {self.base_model!r} is not running or renders no images")
        result: dict[str, Any] = await self._renderer.render_chat_completion(payload)
        return result

    async def _prefetch(self, weights: SamplerWeights) -> None:
        await self._release(await self._acquire(weights))

    async def _close(self) -> None:
        # At shutdown the weight-sync group is not torn down politely: the engine's workers exit
        # with it, and a collective with an engine that is already gone would only wait out its timeout.
        engine, self._engine, self._transport, self._renderer = self._engine, None, None, None
        if self.slots is not None:
            self.slots.forget()
        if engine is not None:
            await asyncio.wait_for(engine.close(), 60.0)

    # ---------------------------------------------------------------- public (any loop)
    async def sample(
        self, weights: SamplerWeights, prompt: list[int], params: SamplingParams, scores: PromptScores
    ) -> SampleResult:
        """Sample `params.n` continuations of `prompt` with `weights`, and score the prompt as
        `scores` asks."""
        return await self._on_engine_loop(self._sample(weights, prompt, params, scores))

    async def sample_images(
        self, weights: SamplerWeights, parts: Sequence[list[int] | ImageInput], params: SamplingParams
    ) -> SampleResult:
        """Sample continuations of a prompt with images (a vision-language engine)."""
        return await self._on_engine_loop(self._sample_images(weights, parts, params))

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """vLLM's chat render route, served by the running engine's renderer (`RenderClient`)."""
        return await self._on_engine_loop(self._render(payload))

    async def prefetch(self, weights: SamplerWeights) -> None:
        """Start the engine if needed and load `weights` (no generation)."""
        await self._on_engine_loop(self._prefetch(weights))

    def stats(self) -> dict[str, Any]:
        """How this engine serves LoRA samplers and its adapter slots (GET /api/v1/server_stats)."""
        mode = (
            self.lora_mode.report() if self.lora_mode is not None else {"mode": None, "reason": "not started"}
        )
        return {
            **mode,
            "full_weights": self._tag,
            "adapters": self.slots.report() if self.slots else None,
            "prompt_scoring_swaps": self.prompt_scoring_swaps,
        }

    def close(self, timeout_s: float = 120.0) -> None:
        """Shut the engine down and stop its thread (blocking; call from outside its loop)."""
        loop_thread, self._loop_thread = self._loop_thread, None
        if loop_thread is None:
            return
        if self._engine is not None:
            try:
                loop_thread.run(self._close(), timeout_s)
            except Exception as exc:
                logger.warning("engine shutdown failed: %s", exc)
        try:
            loop_thread.stop(timeout_s=10)
        except RuntimeError as exc:
            logger.warning("%s", exc)
