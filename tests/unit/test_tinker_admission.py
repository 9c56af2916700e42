"""Training admission (`skylift.tinker.training.admission`): a client that does not fit the memory budget
or its user's caps is refused with a 400 saying what it needs and what is in use; the server keeps
serving. The estimates match what the clients really hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tinker_app import API, result, session

from skylift.tinker.app import create_app
from skylift.tinker.core.auth import KeyFileError, UserCaps, parse_users_file
from skylift.tinker.service import ServerConfig
from skylift.tinker.training.admission import Admission, CapacityError, estimate
from skylift.tinker.training.base_pool import BasePool
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel

MIB = 1024 * 1024
ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}


def _config(path: Path, rank: int = 8, **kwargs: bool) -> ModelConfig:
    return ModelConfig("tiny", str(path), lora_rank=rank, **kwargs)


def test_the_estimates_are_what_the_clients_hold(tiny_model_dir: Path) -> None:
    pool = BasePool()
    for config in (_config(tiny_model_dir), _config(tiny_model_dir, 4, train_mlp=False, train_unembed=False)):
        model = TrainedModel("m", config, 2, pool)
        model.setup()
        trainable = sum(p.numel() for p in model.worker.model.parameters() if p.requires_grad)
        need = estimate(config)
        assert need.own_bytes == trainable * 16  # weight, gradient, two AdamW moments in float32
        resident = pool.resident(str(tiny_model_dir))
        params = sum(p.numel() for p in resident.template.parameters())
        assert need.base_bytes == params * 4
        model.close()
    full = estimate(_config(tiny_model_dir, 0))
    assert not full.lora and full.own_bytes == params * 16


def test_the_base_counts_once_and_a_client_beyond_the_budget_is_refused(tiny_model_dir: Path) -> None:
    lora, full = estimate(_config(tiny_model_dir)), estimate(_config(tiny_model_dir, 0))
    admission = Admission(lora.base_bytes + 2 * lora.own_bytes + 1000, UserCaps())
    admission.admit("a", _config(tiny_model_dir), "alice")
    admission.admit("b", _config(tiny_model_dir), "bob")
    assert admission.stats()["in_use_bytes"] == lora.base_bytes + 2 * lora.own_bytes
    with pytest.raises(CapacityError) as refused:
        admission.admit("c", _config(tiny_model_dir), "alice")
    message = str(refused.value)
    assert f"needs {lora.own_bytes / MIB:.1f} MiB" in message and "already resident" in message
    assert f"{(lora.base_bytes + 2 * lora.own_bytes) / MIB:.1f} MiB of the server's" in message
    assert "--training-memory-gb" in message
    admission.admit("a", _config(tiny_model_dir), "alice")  # an admitted id passes again
    with pytest.raises(CapacityError, match="a model of its own"):
        admission.admit("f", _config(tiny_model_dir, 0), "alice")
    admission.release("b")
    admission.admit("c", _config(tiny_model_dir), "alice", reserve=False)  # a check reserves nothing
    assert admission.stats()["training_clients"] == 1
    admission.release("a")
    assert admission.stats()["in_use_bytes"] == 0 and admission.stats()["refusals"] == 2
    alone = Admission(full.own_bytes, UserCaps())
    alone.admit("f", _config(tiny_model_dir, 0), "alice")
    assert alone.stats("alice")["you"]["training_clients"] == 1


def test_caps_per_user_from_the_flags_and_the_users_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.write_text("alice tml-a max_adapters=1\nalice tml-a2\nbob tml-b max_clients=1 # one\ncarol tml-c\n")
    keys, caps = parse_users_file(users)
    assert keys == {"tml-a": "alice", "tml-a2": "alice", "tml-b": "bob", "tml-c": "carol"}
    assert caps == {"alice": UserCaps(max_adapters=1), "bob": UserCaps(max_clients=1)}
    admission = Admission(10**12, UserCaps(max_clients=3, max_adapters=2), caps.get)
    admission.admit("a1", _config(tiny_model_dir), "alice")
    with pytest.raises(CapacityError, match=r"user 'alice' already has 1 LoRA adapters \(cap 1\)"):
        admission.admit("a2", _config(tiny_model_dir), "alice")
    admission.admit("a3", _config(tiny_model_dir, 0), "alice")  # a full fine-tune is no adapter
    admission.admit("b1", _config(tiny_model_dir, 0), "bob")
    with pytest.raises(CapacityError, match=r"already has 1 live training clients \(cap 1\)"):
        admission.admit("b2", _config(tiny_model_dir), "bob")
    for i in range(2):
        admission.admit(f"c{i}", _config(tiny_model_dir), "carol")
    with pytest.raises(CapacityError, match=r"cap 2"):
        admission.admit("c9", _config(tiny_model_dir), "carol")
    assert admission.stats("carol")["you"] == {
        "user": "carol",
        "training_clients": 2,
        "lora_adapters": 2,
        "max_clients": 3,
        "max_adapters": 2,
    }


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("alice tml-a max_clients=0", "N >= 1"),
        ("alice tml-a max_gpus=2", "NAME one of max_clients, max_adapters"),
        ("alice tml-a 7", "caps NAME=N"),
        ("alice tml-a max_clients=2\nalice tml-b max_clients=3", "other caps on an earlier line"),
    ],
)
def test_a_bad_cap_in_the_users_file_names_its_line(tmp_path: Path, line: str, error: str) -> None:
    users = tmp_path / "users"
    users.write_text(line + "\n")
    with pytest.raises(KeyFileError, match=error):
        parse_users_file(users)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    """An app whose budget holds the tiny base and a few rank-8 adapters, never a full fine-tune."""
    tmp = tmp_path_factory.mktemp("tinker-admission")
    keys = tmp / "keys"
    keys.write_text("alice tml-alice max_adapters=2\nbob tml-bob\n")
    config = ServerConfig(
        base_models=[str(tiny_model_dir)],
        db_url=f"sqlite:///{tmp / 'tinker.db'}",
        data_dir=tmp / "data",
        api_keys_file=keys,
        training_memory_gb=10 / 1024,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        client.tiny_model_dir = tiny_model_dir  # type: ignore[attr-defined]
        yield client


def _create(client: TestClient, headers: dict[str, str], session_id: str, seq: int, rank: int):
    body = {
        "session_id": session_id,
        "model_seq_id": seq,
        "base_model": str(client.tiny_model_dir),  # type: ignore[attr-defined]
        "lora_config": {"rank": rank},
    }
    return client.post(f"{API}/create_model", json=body, headers=headers)


def test_a_client_that_does_not_fit_gets_a_400_and_the_server_keeps_serving(small: TestClient) -> None:
    service = small.app.state.service  # type: ignore[attr-defined]
    alice, bob = session(small, ALICE), session(small, BOB)
    first = _create(small, ALICE, alice, 0, 8)
    assert first.status_code == 200, first.text
    assert result(small, first.json()["request_id"], ALICE)["model_id"] == f"{alice}:train:0"
    again = _create(small, ALICE, alice, 0, 8)  # the SDK's retry of the same POST: the same future
    assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
    full = _create(small, BOB, bob, 0, 0)
    assert full.status_code == 400, full.text
    message = full.json()["error"]
    assert "not enough training memory" in message and "needs 15.3 MiB" in message
    assert "of the server's 10.0 MiB are in use by 1 training clients" in message
    assert f"{bob}:train:0" not in service.models
    second = _create(small, BOB, bob, 1, 8)  # another LoRA client of the same base fits
    assert result(small, second.json()["request_id"], BOB)["model_id"] == f"{bob}:train:1"
    a, b = service.models[f"{alice}:train:0"], service.models[f"{bob}:train:1"]
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    pa, pb = dict(a.worker.model.named_parameters())[name], dict(b.worker.model.named_parameters())[name]
    assert pa is pb and pa.untyped_storage().data_ptr() == pb.untyped_storage().data_ptr()
    assert _create(small, ALICE, alice, 1, 8).status_code == 200
    capped = _create(small, ALICE, alice, 2, 8)
    assert capped.status_code == 400 and "(cap 2)" in capped.json()["error"]
    stats = small.get(f"{API}/server_stats", headers=ALICE).json()
    training = stats["training"]
    assert [b["lora_clients"] for b in training["resident_base_models"]] == [3]
    assert training["base_loads"] == 1 and training["refusals"] == 2
    assert training["you"]["lora_adapters"] == 2 and training["you"]["max_adapters"] == 2
    assert training["lora_adapters"] == 3 and training["slots"]["total"] == 1
    finish = small.post(f"{API}/sessions/{alice}/finish", json={"reason": {"type": "success"}}, headers=ALICE)
    assert finish.status_code == 200
    training = small.get(f"{API}/server_stats", headers=BOB).json()["training"]
    assert training["training_clients"] == 1 and training["base_evictions"] == 0
    assert "you" in training and training["you"]["user"] == "bob"
