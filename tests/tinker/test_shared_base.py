"""LoRA clients of one base share it, through the SDK: the base is resident once, adapters trained
interleaved equal the same adapters trained alone, and a client beyond the server's memory budget
is refused with a 400 while the others keep training (docs/tinker.md, "Sharing one base model")."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from server_helpers import TinkerServer
from tinker import types
from tinker_helpers import datum, logprobs_of

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"  # the servers' key (as tests/tinker/conftest.py's)
ADAM = types.AdamParams(learning_rate=1e-2)


def _stats(server: TinkerServer) -> dict[str, Any]:
    req = urllib.request.Request(f"{server.url}/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read())["training"])


def _clients_of_tiny(stats: dict[str, Any]) -> list[int]:
    return [
        b["lora_clients"] for b in stats["resident_base_models"] if b["model_path"].endswith("tiny-qwen2")
    ]


def _rows(offset: int) -> list[types.Datum]:
    return [datum([4 + (offset + 5 * i + 3 * j) % 45 for j in range(16)]) for i in range(3)]


PROBE = datum([7 + (j * 11) % 40 for j in range(14)])


def test_lora_clients_share_the_base_and_train_as_if_alone(service_client, tinker_server) -> None:
    before = _clients_of_tiny(_stats(tinker_server))
    a = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=8, seed=11).result()
    b = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=8, seed=12).result()
    shared = _clients_of_tiny(_stats(tinker_server))
    assert len(shared) == 1 and shared[0] == (before[0] if before else 0) + 2  # one resident base
    for _ in range(3):  # both clients' operations in flight at once, interleaved on the server
        futures = [
            a.forward_backward(_rows(0), "cross_entropy"),
            b.forward_backward(_rows(9), "cross_entropy"),
        ]
        futures += [a.optim_step(ADAM), b.optim_step(ADAM)]
        for f in futures:
            f.result()
    alone = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=8, seed=11).result()
    for _ in range(3):
        alone.forward_backward(_rows(0), "cross_entropy").result()
        alone.optim_step(ADAM).result()
    got, want = (logprobs_of(c.forward([PROBE], "cross_entropy").result()) for c in (a, alone))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    other = logprobs_of(b.forward([PROBE], "cross_entropy").result())
    assert np.abs(other - got).max() > 1e-3  # b learnt other data: its adapter is its own


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TinkerServer]:
    """A server whose training budget holds the tiny base and a few rank-8 adapters, never a full
    fine-tune (16 MiB); no engine ever starts."""
    from server_helpers import require_loopback_namespace

    require_loopback_namespace()
    tmp = tmp_path_factory.mktemp("tinker-small")
    extra = ["--training-memory-gb", str(10 / 1024)]
    env = {"SKYLIFT_TINKER_FAIL_ENGINE_START": "1"}
    with TinkerServer(data_dir=tmp / "data", log_path=tmp / "small.log", extra_args=extra, env=env) as server:
        yield server


def test_a_client_beyond_the_memory_budget_gets_a_400_and_the_others_keep_training(small_server) -> None:
    service = tinker.ServiceClient(base_url=small_server.url, api_key=API_KEY)
    try:
        lora = service.create_lora_training_client(base_model="tiny-qwen2", rank=8).result()
        with pytest.raises(tinker.BadRequestError) as refused:
            service.create_lora_training_client(base_model="tiny-qwen2", rank=0).result()
        assert refused.value.status_code == 400
        message = str(refused.value)
        assert "not enough training memory" in message and "needs 15.3 MiB" in message
        assert "in use by 1 training clients" in message
        lora.forward_backward(_rows(0), "cross_entropy").result()
        assert lora.optim_step(ADAM).result().metrics["grad_norm"] > 0
        second = service.create_lora_training_client(base_model="tiny-qwen2", rank=8).result()
        second.forward_backward(_rows(3), "cross_entropy").result()
        stats = _stats(small_server)
        assert stats["refusals"] == 1 and stats["lora_adapters"] == 2 and _clients_of_tiny(stats) == [2]
    finally:
        service.close("success").result(timeout=60)


def _sampling_stats(server: TinkerServer) -> dict[str, Any]:
    req = urllib.request.Request(f"{server.url}/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        engines = json.loads(resp.read())["sampling"]["engines"]
    return next(e for e in engines if e["base_model"].endswith("tiny-qwen2"))


def test_four_users_sample_their_own_adapters_at_once(tinker_server, sampler_lora_slots: int) -> None:
    """Four LoRA clients train on different data, then sample and score at once through one engine:
    each sampler's logprobs are its own adapter's (as its training forward says), never another's;
    with more adapters than slots they are evicted and reloaded, and sample the same. Three sample
    ephemeral snapshots, one a named sampler checkpoint (its `adapter/` folder)."""
    from concurrent.futures import ThreadPoolExecutor

    users = [tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY) for _ in range(4)]
    try:
        clients = [
            # vLLM 0.32 takes no unembedding adapters of Qwen2 (the tiny model's architecture)
            u.create_lora_training_client(
                base_model="tiny-qwen2", rank=8, seed=30 + i, train_unembed=False
            ).result()
            for i, u in enumerate(users)
        ]
        for _ in range(3):
            futures = [c.forward_backward(_rows(7 * i), "cross_entropy") for i, c in enumerate(clients)]
            futures += [c.optim_step(ADAM) for c in clients]
            for f in futures:
                f.result()
        samplers = [c.save_weights_and_get_sampling_client().result() for c in clients[:3]]
        named = clients[3].save_weights_for_sampler("shared-base-user-3").result().path  # from its checkpoint
        samplers.append(users[3].create_sampling_client(model_path=named).result())
        full = types.ModelInput.from_ints(
            PROBE.model_input.to_ints() + [int(PROBE.loss_fn_inputs["target_tokens"].data[-1])]
        )
        params = types.SamplingParams(max_tokens=6, seed=1)

        def sample_and_score(i: int) -> np.ndarray:
            sampled = samplers[i].sample(PROBE.model_input, num_samples=2, sampling_params=params)
            scored = samplers[i].compute_logprobs(full)
            assert len(sampled.result().sequences) == 2
            return np.asarray(scored.result()[1:], dtype=float)

        with ThreadPoolExecutor(4) as pool:
            engine_lps = list(pool.map(sample_and_score, range(4)))
        trainer_lps = [logprobs_of(c.forward([PROBE], "cross_entropy").result()) for c in clients]
        for i in range(4):
            gaps = [np.abs(engine_lps[i] - t).max() for t in trainer_lps]
            assert gaps[i] <= 1e-3, gaps  # its own adapter, as trained ...
            assert min(g for j, g in enumerate(gaps) if j != i) > 1e-3, gaps  # ... not another's
        stats = _sampling_stats(tinker_server)
        assert stats["mode"] == "adapters" and stats["full_weights"] == "base"  # nothing merged pushed
        adapters = stats["adapters"]
        assert adapters["slots"] == sampler_lora_slots and adapters["evictions"] >= 4 - sampler_lora_slots
        for i in range(1, sampler_lora_slots + 1):  # the slots now hold others' adapters ...
            sample_and_score(i)
        again = sample_and_score(0)  # ... so user 0's is evicted: loaded again, the same
        np.testing.assert_allclose(again, engine_lps[0], rtol=0, atol=1e-4)
        assert _sampling_stats(tinker_server)["adapters"]["loads"] > adapters["loads"]
    finally:
        for u in users:
            u.close("success").result(timeout=60)


def test_an_adapter_the_engine_cannot_batch_is_merged_into_the_base_on_demand(
    service_client, tinker_server
) -> None:
    """Tinker's default adapter covers the unembedding, which vLLM 0.32 serves for no Qwen2 model:
    its snapshot still holds only the adapter, merged into the base when it is swapped in."""
    tc = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=8, seed=40).result()
    for _ in range(2):
        tc.forward_backward(_rows(3), "cross_entropy").result()
        tc.optim_step(ADAM).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    full = types.ModelInput.from_ints(
        PROBE.model_input.to_ints() + [int(PROBE.loss_fn_inputs["target_tokens"].data[-1])]
    )
    engine_lp = np.asarray(sampler.compute_logprobs(full).result()[1:], dtype=float)
    trainer_lp = logprobs_of(tc.forward([PROBE], "cross_entropy").result())
    np.testing.assert_allclose(engine_lp, trainer_lp, rtol=0, atol=1e-3)
    assert _sampling_stats(tinker_server)["full_weights"].startswith("ephemeral:")  # swapped in
