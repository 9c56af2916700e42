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
