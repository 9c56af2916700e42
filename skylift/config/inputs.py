"""The prompt data and environment groups of the schema (``data.*``, ``environment.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.config.fields import _f, _group
from skylift.config.harness import HarnessConfig

# --------------------------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where the prompts come from and how their rows are read."""

    train_data: list[str] = _f(
        ["~/data/gsm8k/train.parquet"], "training prompt files (parquet); a single path is accepted too"
    )
    val_data: list[str] = _f(
        ["~/data/gsm8k/validation.parquet"], "evaluation prompt files (parquet); [] disables evaluation data"
    )
    prompt_key: str = _f("prompt", "column holding the prompt as a list of chat messages")
    env_class_key: str = _f(
        "env_class", "column naming each row's environment (falls back to environment.env_class)"
    )
    shuffle: bool = _f(True, "shuffle training prompts every epoch (seeded by trainer.seed)")
    max_train_samples: int | None = _f(None, "use at most this many training prompts; null = all", ge=1)
    max_val_samples: int | None = _f(None, "use at most this many evaluation prompts; null = all", ge=1)


# -------------------------------------------------------------------------------------- environment


@dataclass
class EnvironmentConfig:
    """Reward environments."""

    env_class: str = _f(
        "gsm8k",
        "default environment for rows without an env_class column: a registered name (gsm8k, "
        "arithmetic, the ids of the environment plugins' registries), or package.module:Class",
    )
    max_env_workers: int = _f(0, "threads for env.step calls; 0 = run them inline", ge=0)
    env_kwargs: dict[str, Any] = _f(
        {}, "keyword arguments for the environment, e.g. environment.env_kwargs.x=1"
    )
    import_modules: list[str] = _f(
        [],
        "modules imported before the run, for their register_env calls (or a gym "
        "registry's register calls; then env_class may name what they register)",
    )
    env_configs: dict[str, Any] = _f(
        {},
        "the env_config of gym-registry environments, by registered id, e.g. "
        "environment.env_configs.text2sql.db_path=... (SkyRL command lines' name for the group works too)",
    )
    # agentic environments (issue 31): the model an environment calls, and its tools
    llm_base_url: str | None = _f(
        None,
        "OpenAI-compatible API root (http://host:port/v1) environments call as self.llm (a judge, a "
        "user simulator); null = the policy's own engines",
    )
    llm_model: str = _f("default", "model name sent to environment.llm_base_url")
    llm_timeout_s: float = _f(60.0, "timeout in seconds of one call to environment.llm_base_url", gt=0)
    tool_timeout_s: float = _f(
        10.0, "timeout in seconds of one tool call (the call fails, the rollout goes on)", gt=0
    )
    max_concurrent_tool_calls: int = _f(8, "tool calls running at once, over all trajectories", ge=1)
    verifiers: dict[str, Any] = _f(
        {},
        "a verifiers 0.4 env server that plays the rows of env_class verifiers on the run's remote "
        "engines: address (tcp://host:port, required), model, renderer_model, client, sampling, "
        "task_key, health_timeout_s, run_timeout_s (docs/agentic.md)",
    )
    harness: HarnessConfig = _group(
        HarnessConfig, "an existing agent program trained through the OpenAI-compatible gateway"
    )
