"""Typed settings of the inference and Tinker servers (skylift.config.services)."""

from __future__ import annotations

import pytest

from skylift.config.services import EngineSettings, InferenceServerLimits, ServerConfig
from skylift.inference import limits


def test_inference_limits_come_from_the_environment_with_typed_defaults() -> None:
    assert InferenceServerLimits.from_env({}) == InferenceServerLimits()
    got = InferenceServerLimits.from_env({"SKYLIFT_MAX_N": "8", "SKYLIFT_WEIGHT_RPC_TIMEOUT_S": "1.5"})
    assert (got.max_n, got.max_prompts, got.weight_rpc_timeout_s) == (8, 4096, 1.5)
    with pytest.raises(ValueError, match="SKYLIFT_MAX_PROMPTS must be a number, got 'many'"):
        InferenceServerLimits.from_env({"SKYLIFT_MAX_PROMPTS": "many"})
    with pytest.raises(ValueError, match="SKYLIFT_MAX_N must be >= 1, got '0'"):
        InferenceServerLimits.from_env({"SKYLIFT_MAX_N": "0"})
    with pytest.raises(ValueError, match="SKYLIFT_WEIGHT_RPC_TIMEOUT_S must be > 0"):
        InferenceServerLimits.from_env({"SKYLIFT_WEIGHT_RPC_TIMEOUT_S": "-1"})
    # the server's module-level limits are this process's settings
    assert (
        limits.MAX_N == limits.LIMITS.max_n
        and limits.WEIGHT_RPC_TIMEOUT_S == limits.LIMITS.weight_rpc_timeout_s
    )


def test_tinker_settings_are_the_config_packages() -> None:
    from skylift.tinker import ServerConfig as TinkerServerConfig
    from skylift.tinker.sampling.engine_host import EngineSettings as TinkerEngineSettings

    assert TinkerServerConfig is ServerConfig and TinkerEngineSettings is EngineSettings
    config = ServerConfig(base_models=["tiny-qwen2"])
    assert config.engine == EngineSettings() and config.engine is not ServerConfig(base_models=[]).engine
