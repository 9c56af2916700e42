"""Typed configuration: a dataclass tree (data, trainer, generator, environment) with dotlist overrides.

cfg = load_config(["trainer.train_batch_size=16", "generator.remote_inference_engine_urls=['127.0.0.1:8001']"])
cfg.trainer.train_batch_size  # 16
print(format_config(cfg, with_help=True))
"""

from skylift.config.algorithm import AlgorithmConfig, CISPOConfig, DynamicSamplingConfig, KLCtrlConfig
from skylift.config.dialects import key_aliases
from skylift.config.errors import ConfigError
from skylift.config.formatting import format_config, to_dict
from skylift.config.keys import config_keys, field_help
from skylift.config.loading import default_config, load_config, parse_override
from skylift.config.schema import (
    CriticConfig,
    DataConfig,
    EnvironmentConfig,
    EvalSamplingConfig,
    FSDPConfig,
    GeneratorConfig,
    LoraConfig,
    ModelWeightsConfig,
    OptimizerConfig,
    PlacementConfig,
    PolicyConfig,
    RefConfig,
    SamplingConfig,
    SkyliftConfig,
    TrainerConfig,
)
from skylift.config.validation import finalize, validate_config

__all__ = [
    "AlgorithmConfig",
    "CISPOConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EnvironmentConfig",
    "EvalSamplingConfig",
    "FSDPConfig",
    "GeneratorConfig",
    "KLCtrlConfig",
    "LoraConfig",
    "ModelWeightsConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "PolicyConfig",
    "RefConfig",
    "SamplingConfig",
    "SkyliftConfig",
    "TrainerConfig",
    "config_keys",
    "default_config",
    "field_help",
    "finalize",
    "format_config",
    "key_aliases",
    "load_config",
    "parse_override",
    "to_dict",
    "validate_config",
]
