"""Fixtures shared by every test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Everything runs offline and on loopback; vLLM on CPU gets a small KV cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
