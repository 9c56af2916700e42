"""An adapter of the unembedding (Tinker's default `train_unembed`) on a model whose unembedding
vLLM adapts in the batch (SmolLM2, Llama family): it samples as an adapter, and its prompt
scores (`compute_logprobs`) come from its merged weights, equal to its training forward, because
vLLM 0.32 scores prompts without an lm_head adapter's delta (CUDA) or dies doing so (CPU):
`skylift.inference.vllm_patches.lora_prompt_logprobs`. The engine keeps serving after it. With
every adapter slot of a batch taken (`--sampler-max-loras 2`, two samplers), requests without an
adapter (the base model, merged weights swapped in) get no adapter's delta: on CPU vLLM's ops
gave them the last slot's (`skylift.inference.vllm_patches.cpu_lora_no_adapter`).

One server of its own on SmolLM2-135M-Instruct (the tiny Qwen2 model's unembedding takes no
adapter in vLLM 0.32, so the shared server never meets this path)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from server_helpers import TinkerServer, require_loopback_namespace
from tinker import types
from tinker_helpers import datum, logprobs_of

from skylift.models import prepare_model

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"  # the server's key (as tests/tinker/conftest.py's)
MODEL = "smollm2-135m-instruct"
ROWS = [datum([1 + (17 * i + 5 * j) % 400 for j in range(12)]) for i in range(2)]
PROBE = datum([504, 3458, 282, 253, 1345, 7536, 30, 216, 1183, 314, 260])


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    require_loopback_namespace()
    prepare_model(MODEL)
    tmp: Path = tmp_path_factory.mktemp("tinker-smollm2")
    with TinkerServer(
        data_dir=tmp / "data",
        log_path=tmp / "server.log",
        base_model=MODEL,
        extra_args=["--sampler-lora", "adapters", "--sampler-max-loras", "2", "--max-model-len", "256"],
    ) as server:
        yield server


def _engine_stats(server: TinkerServer) -> dict[str, Any]:
    req = urllib.request.Request(f"{server.url}/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read())["sampling"]["engines"][0])


def test_an_unembedding_adapter_samples_in_the_batch_and_scores_its_prompt_as_trained(
    smollm2_server: TinkerServer,
) -> None:
    service = tinker.ServiceClient(base_url=smollm2_server.url, api_key=API_KEY)
    try:
        full = types.ModelInput.from_ints(
            PROBE.model_input.to_ints() + [int(PROBE.loss_fn_inputs["target_tokens"].data[-1])]
        )
        base_sampler = service.create_sampling_client(base_model=MODEL).result()
        base_before = np.asarray(base_sampler.compute_logprobs(full).result()[1:], dtype=float)
        trainers, samplers = [], []
        for seed in (3, 4):  # the unembedding alone: all of each adapter's effect is what vLLM mishandles
            trainer = service.create_lora_training_client(
                base_model=MODEL, rank=8, seed=seed, train_mlp=False, train_attn=False
            ).result()
            for _ in range(2):
                trainer.forward_backward(ROWS[seed - 3 :], "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            trainers.append(trainer)
            samplers.append(trainer.save_weights_and_get_sampling_client().result())
        params = types.SamplingParams(max_tokens=4, seed=1)
        for sampler in samplers:  # both adapters in the batch's two slots
            sampled = sampler.sample(PROBE.model_input, num_samples=2, sampling_params=params).result()
            assert len(sampled.sequences) == 2
        stats = _engine_stats(smollm2_server)
        assert stats["mode"] == "adapters" and stats["adapts_unembedding"], stats
        assert stats["full_weights"] == "base" and stats["prompt_scoring_swaps"] == 0  # in the batch

        base_after = np.asarray(base_sampler.compute_logprobs(full).result()[1:], dtype=float)
        np.testing.assert_allclose(base_after, base_before, rtol=0, atol=1e-5)  # no adapter's delta
        busy = types.SamplingParams(max_tokens=24, seed=2)
        running = [s.sample(PROBE.model_input, num_samples=2, sampling_params=busy) for s in samplers]
        during = base_sampler.compute_logprobs(full)  # prompt rows in a step beside 4 sequences
        np.testing.assert_allclose(
            np.asarray(during.result()[1:], dtype=float), base_before, rtol=0, atol=1e-5
        )
        assert all(len(f.result().sequences) == 2 for f in running)
        engine = np.asarray(samplers[0].compute_logprobs(full).result()[1:], dtype=float)
        trained = [logprobs_of(t.forward([PROBE], "cross_entropy").result()) for t in trainers]
        base_gap = np.abs(base_before - trained[0]).max()
        assert base_gap > 1e-2, base_gap  # the adapter moves these scores: the check below means something
        assert np.abs(trained[1] - trained[0]).max() > 1e-2  # as does the other one
        np.testing.assert_allclose(engine, trained[0], rtol=0, atol=1e-3)
        assert _engine_stats(smollm2_server)["prompt_scoring_swaps"] == 1
        sampler = samplers[0]

        again = sampler.sample(PROBE.model_input, num_samples=1, sampling_params=params).result()
        assert len(again.sequences) == 1  # the engine serves on
    finally:
        service.close("success").result(timeout=60)
