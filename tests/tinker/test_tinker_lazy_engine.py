"""Training never starts an inference engine; the server survives an engine that cannot start;
records and checkpoints survive a restart; sessions without heartbeats are cleaned up."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker_helpers import logprobs_of, sft_dataset

pytestmark = pytest.mark.integration


def test_sft_without_engine_then_restart(no_engine_server) -> None:
    server = no_engine_server
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-dummy")
    tc = client.create_lora_training_client(base_model="tiny-qwen2", rank=8).result()
    data = sft_dataset()
    tc.forward(data, "cross_entropy").result()
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("after-sft").result().path
    assert server.status()["engine_start_attempts"] == 0  # pure SFT never touched an engine

    # Sampling needs the engine: a clear error result, and the server keeps serving.
    sampler = client.create_sampling_client(base_model="tiny-qwen2").result()
    with pytest.raises(tinker.RequestFailedError) as info:
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result()
    assert "failed to start" in str(info.value) and "SKYLIFT_TINKER_FAIL_ENGINE_START" in str(info.value)
    assert server.status()["engine_start_attempts"] >= 1
    tc.forward_backward(data, "cross_entropy").result()
    expected = logprobs_of(tc.forward([data[0]], "cross_entropy").result())  # no step since the save
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()
    model_id = tc.model_id
    client.close("success").result(timeout=60)

    server.stop()
    server.start()  # same database and data directory
    rest = tinker.RestClient(base_url=server.url, api_key="tml-dummy")
    assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [state]
    assert model_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-dummy")
    resumed = client.create_training_client_from_state_with_optimizer(state).result()
    np.testing.assert_allclose(
        logprobs_of(resumed.forward([data[0]], "cross_entropy").result()), expected, atol=1e-5
    )
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(model_id).result().checkpoints == []
    client.close("success").result(timeout=60)
    assert server.status()["engine_start_attempts"] == 0


def test_stale_sessions_are_finished(no_engine_server) -> None:
    """A session without heartbeats for --session-timeout (15 s here) is finished: heartbeats get 410."""
    url, headers = no_engine_server.url, {"X-API-Key": "tml-dummy"}
    body = {"tags": [], "user_metadata": {}, "sdk_version": "test"}
    sid = httpx.post(f"{url}/api/v1/create_session", json=body, headers=headers).json()["session_id"]
    assert (
        httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": sid}, headers=headers).status_code
        == 200
    )
    time.sleep(18)
    assert (
        httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": sid}, headers=headers).status_code
        == 410
    )
