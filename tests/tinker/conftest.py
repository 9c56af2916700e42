"""Tinker-service servers for the tests, driven with the real `tinker` SDK (api key `tml-dummy`).

`tinker_server`: ONE `skylift tinker serve` subprocess on the tiny model for the whole session; its
inference engine starts lazily on the first sample and is shared by every test. It serves LoRA
samplers as adapters in the batch (not by the start-up measurement, whose choice on the tiny model
depends on the machine's load) in two slots: tests with more LoRA samplers evict and reload.
`no_engine_server`: a second server whose engine start-up always fails
(SKYLIFT_TINKER_FAIL_ENGINE_START=1), with a short session timeout; it never runs vLLM, so it is
cheap, and tests restart it on the same database and data directory.

Run inside a loopback-only namespace: unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/tinker'
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import TinkerServer, require_loopback_namespace

API_KEY = "tml-dummy"
SAMPLER_LORA_SLOTS = 2  # tinker_server's adapter slots


def _server(tmp: Path, tiny_model_dir: Path, name: str, **kwargs) -> Iterator[TinkerServer]:
    require_loopback_namespace()
    assert tiny_model_dir.is_dir()
    with TinkerServer(data_dir=tmp / name, log_path=tmp / f"{name}.log", **kwargs) as server:
        yield server


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TinkerServer]:
    lora = ["--sampler-lora", "adapters", "--sampler-lora-slots", str(SAMPLER_LORA_SLOTS)]
    yield from _server(tmp_path_factory.mktemp("tinker"), tiny_model_dir, "main", extra_args=lora)


@pytest.fixture(scope="session")
def sampler_lora_slots() -> int:
    """The adapter slots `tinker_server` runs with (a fixture: another folder's conftest may be the
    module `conftest` when the halves run together)."""
    return SAMPLER_LORA_SLOTS


@pytest.fixture(scope="session")
def no_engine_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[TinkerServer]:
    yield from _server(
        tmp_path_factory.mktemp("tinker-noengine"),
        tiny_model_dir,
        "noengine",
        extra_args=["--session-timeout", "15", "--cleanup-interval", "1"],
        env={"SKYLIFT_TINKER_FAIL_ENGINE_START": "1"},
    )


@pytest.fixture
def service_client(tinker_server: TinkerServer) -> Iterator:
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)
