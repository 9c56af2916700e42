"""Fixtures shared by every test suite.

`tiny_server` / `tiny_server_url` is ONE `skylift serve` subprocess on the tiny model (fp32,
max_model_len 512) for the whole session, `tiny_server_with_key` a second one that requires
`TEST_API_KEY` and binds the server's default host (tests/reliability/test_auth.py checks that the
default is loopback). Both start on first use and stop at the end of the session; see
tests/server_helpers.py for launching them and the loopback-only namespace they need.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import (
    TEST_API_KEY,
    ServerHandle,
    require_loopback_namespace,
    start_server,
    stop_server,
    tiny_server_args,
    wait_healthy,
)

# Everything runs offline and on loopback. (No VLLM_CPU_KVCACHE_SPACE: a CPU engine sizes its KV
# cache to its model and max_model_len, skylift.inference.engine_args.cpu_kv_cache_default.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny Qwen2 model (~1M params), built once and cached on disk."""
    from skylift.models import prepare_model

    return prepare_model("tiny-qwen2")


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """GSM8K jsonl files shipped beside the project (shared/data/gsm8k), or skip."""
    env = os.environ.get("SKYLIFT_GSM8K_DIR")
    candidates = [Path(env)] if env else []
    root = Path(__file__).resolve().parents[1]
    candidates += [root.parent / "shared" / "data" / "gsm8k", root / "data" / "gsm8k"]
    for path in candidates:
        if (path / "train.jsonl").is_file():
            return path
    pytest.skip("GSM8K jsonl not found (set SKYLIFT_GSM8K_DIR)")


def _serve(
    model_dir: Path, log_path: Path, api_key: str | None, host: str | None, delta_root: Path
) -> Iterator[ServerHandle]:
    require_loopback_namespace()
    # delta sync may read and write under the session's temp root (where the tests' sync dirs are)
    args = [*tiny_server_args(), "--delta-sync-root", str(delta_root)]
    handle = start_server(model_dir, log_path, args, api_key=api_key, host=host)
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """One skylift server on the tiny model for the whole session (no API key, --host 127.0.0.1)."""
    log = tmp_path_factory.mktemp("tiny_server") / "server.log"
    yield from _serve(tiny_model_dir, log, None, "127.0.0.1", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_server_url(tiny_server: ServerHandle) -> str:
    """Base URL (http://127.0.0.1:PORT) of the session's tiny-model server."""
    return tiny_server.url


@pytest.fixture(scope="session")
def tiny_server_with_key(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    """A second tiny-model server that requires `TEST_API_KEY`; started without --host (default bind)."""
    log = tmp_path_factory.mktemp("tiny_server_key") / "server.log"
    # with vLLM's scale-out routes, like `tiny_server`: tests/reliability/test_fuzz_server.py fuzzes
    # vLLM's /inference/v1/generate behind skylift's guard (skylift/inference/vllm_patches/generate_guard.py)
    yield from _serve(tiny_model_dir, log, TEST_API_KEY, None, tmp_path_factory.getbasetemp())
