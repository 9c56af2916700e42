"""`skylift demo`'s settings form a valid configuration."""

from __future__ import annotations

import pytest

from skylift.config import load_config
from skylift.demo import DEMO_OVERRIDES, demo_overrides


def test_demo_overrides_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config(demo_overrides())
    assert cfg.trainer.policy.model.path == "smollm2-135m-instruct"
    assert cfg.generator.kv_cache_gb == 0.5
    assert cfg.trainer.policy.optimizer_config.scheduler == "linear"


def test_user_kv_cache_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM would refuse two KV cache sizes; the demo leaves it to the user's variable."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    overrides = demo_overrides()
    assert not any(o.startswith("generator.kv_cache_gb=") for o in overrides)
    assert len(overrides) == len(DEMO_OVERRIDES) - 1
    assert load_config(overrides).generator.kv_cache_gb is None
