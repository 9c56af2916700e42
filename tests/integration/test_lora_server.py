"""LoRA on the HTTP server: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter semantics,
generation by adapter name, and the LoRA weight sync of a remote engine (in memory over the
weight-update group, and through a directory).

One server started with --enable-lora for the module. Run inside a loopback-only namespace:
    bash scripts/test.sh tests/integration/test_lora_server.py
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import (
    RANK,
    TOLERANCE,
    LoraPolicy,
    adapter_bytes,
    lora_policy,
    max_error,
    perturb_adapter,
)
from server_helpers import (
    ServerHandle,
    require_loopback_namespace,
    start_server,
    stop_server,
    tiny_server_args,
    wait_healthy,
)

from skylift.inference.remote import RemoteInferenceEngine

pytestmark = pytest.mark.integration

SERVED_NAME = "tiny-qwen2"  # tiny_server_args' --served-model-name


def post(url: str, body: dict[str, Any] | bytes) -> tuple[int, Any]:
    """(status, decoded JSON, or the text) of one POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    require_loopback_namespace()
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    args = [*tiny_server_args(), "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2"]
    handle = start_server(tiny_model_dir, log, args)
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="module")
def saved_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter directory of the tiny model (random, non-zero weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear"),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    directory = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(directory)
    return directory


def test_load_route_refuses_bad_input(lora_server: ServerHandle, tmp_path: Path) -> None:
    url = lora_server.url
    status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "a"})
    assert status == 400 and "lora_path" in json.dumps(body)
    status, body = post(
        url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "none")}
    )
    assert status == 404 and "no LoRA adapter at" in json.dumps(body)
    status, body = post(url + "/v1/load_lora_adapter", {"lora_name": SERVED_NAME, "lora_path": str(tmp_path)})
    assert status == 400 and "conflicts with a served base model" in json.dumps(body)
    status, _ = post(url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "x", "bogus": 1})
    assert status in (400, 422)
    status, body = post(url + "/v1/load_lora_adapter", b"not json")
    assert 400 <= status < 500
    status, body = post(url + "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and "cannot be found" in json.dumps(body)
    status, body = post(url + "/v1/unload_lora_adapter", {})
    assert status == 400 and "lora_name" in json.dumps(body)


def test_load_generate_unload(lora_server: ServerHandle, saved_adapter: Path) -> None:
    url = lora_server.url
    status, text = post(url + "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": str(saved_adapter)})
    assert status == 200 and "added successfully" in text, text
    status, body = post(url + "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": str(saved_adapter)})
    assert status == 400 and "already been loaded" in json.dumps(body)
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        assert "ad1" in [m["id"] for m in json.loads(resp.read())["data"]]

    def completion(model: str) -> tuple[int, Any]:
        body = {
            "model": model,
            "prompt": [5, 17, 230, 999],
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 1,
        }
        return post(url + "/v1/completions", body)

    status, with_adapter = completion("ad1")
    assert status == 200, with_adapter
    status, base = completion(SERVED_NAME)
    assert status == 200, base
    assert with_adapter["choices"][0]["logprobs"] != base["choices"][0]["logprobs"]
    gen = {"prompt_token_ids": [[5, 17, 230, 999]], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
    status, skylift_out = post(url + "/skylift/generate", {**gen, "lora_name": "ad1"})
    assert status == 200, skylift_out
    status, missing = post(url + "/skylift/generate", {**gen, "lora_name": "nope"})
    assert status == 404 and "no LoRA adapter named" in json.dumps(missing)

    status, text = post(url + "/v1/unload_lora_adapter", {"lora_name": "ad1"})
    assert status == 200 and "removed successfully" in text
    status, _ = completion("ad1")
    assert status == 404


@pytest.fixture(scope="module")
def remote_policy(tiny_model_dir: Path, loop: Any, lora_server: ServerHandle) -> Iterator[LoraPolicy]:
    engine = RemoteInferenceEngine(lora_server.url)
    # the group's address is derived (the route to the server), as in a run with remote engines
    with lora_policy(tiny_model_dir, loop, [engine], override_existing=True, master_address=None) as policy:
        yield policy


def remote_error(url: str, loop: Any, worker: LoraPolicy) -> float:
    return max_error(RemoteInferenceEngine(url), loop, worker)


def test_remote_lora_sync(
    lora_server: ServerHandle, loop: Any, remote_policy: LoraPolicy, tmp_path: Path
) -> None:
    url = lora_server.url
    for seed, sync_path in ((11, None), (12, None), (13, str(tmp_path))):
        perturb_adapter(remote_policy, seed=seed)
        metrics = remote_policy.sync_weights(lora_sync_path=sync_path)
        assert metrics["weight_sync/bytes"] == adapter_bytes(remote_policy)
        assert remote_error(url, loop, remote_policy) < TOLERANCE
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        adapters = [m["id"] for m in json.loads(resp.read())["data"] if m["id"] != SERVED_NAME]
    assert sorted(a[-3:] for a in adapters) == ["-v2", "-v3"]  # version 1 was unloaded
