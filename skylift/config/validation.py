"""Derived defaults (``finalize``) and semantic checks (``validate_config``) of a ``SkyliftConfig``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skylift.config.errors import ConfigError
from skylift.config.schema import (
    ADVANTAGE_ESTIMATORS,
    INFERENCE_BACKENDS,
    KL_CTRL_TYPES,
    KL_ESTIMATOR_TYPES,
    LOGGERS,
    LOSS_REDUCTIONS,
    LR_SCHEDULERS,
    MODEL_DTYPES,
    PLACEMENT_BACKENDS,
    POLICY_LOSS_TYPES,
    RESUME_MODES,
    STRATEGIES,
    UPDATE_GROUP_OVERRIDES,
    WEIGHT_SYNC_BACKENDS,
    OptimizerConfig,
    SamplingParams,
    SkyliftConfig,
)

_TRUE = {"true", "yes", "on", "1", "enable", "enabled"}
_FALSE = {"false", "no", "off", "0", "disable", "disabled"}


def default_run_root(run_name: str) -> Path:
    """Where a run's checkpoints, exports and logs go unless configured: ``~/skylift/runs/<run_name>``
    (``$SKYLIFT_RUNS_DIR/<run_name>`` when that variable is set)."""
    root = os.environ.get("SKYLIFT_RUNS_DIR")
    return (Path(root).expanduser() if root else Path.home() / "skylift" / "runs") / run_name


def finalize(cfg: SkyliftConfig) -> dict[str, Any]:
    """Fill in derived defaults in place (idempotent); return {dotted key: value} of keys derived from null.

    - ``trainer.ref.model.path`` null -> the policy's path; ``trainer.critic.model.path`` null with
      ``advantage_estimator=gae`` -> the policy's path.
    - ``generator.max_generate_length``, when set, wins over ``generator.sampling_params.max_generate_length``;
      ``generator.eval_sampling_params.max_generate_length`` null -> the training value.
    - ``generator.max_input_length`` null -> ``trainer.max_prompt_length``.
    - ``trainer.ckpt_path`` / ``export_path`` / ``log_dir`` null -> ``~/skylift/runs/<run_name>/{ckpts,exports,logs}``.
    - ``trainer.resume_mode`` null -> ``none``; ``generator.override_existing_update_group`` true/false ->
      ``enable``/``disable``; a leading ``~`` in paths is expanded.
    """
    t, g = cfg.trainer, cfg.generator
    derived: dict[str, Any] = {}

    def derive(key: str, obj: Any, attr: str, value: Any) -> None:
        if getattr(obj, attr) is None:
            setattr(obj, attr, value)
            derived[key] = value

    t.policy.model.path = _expand(t.policy.model.path)
    t.ref.model.path = _expand(t.ref.model.path)
    t.critic.model.path = _expand(t.critic.model.path)
    derive("trainer.ref.model.path", t.ref.model, "path", t.policy.model.path)
    if t.algorithm.advantage_estimator == "gae":
        derive("trainer.critic.model.path", t.critic.model, "path", t.policy.model.path)

    if g.max_generate_length is not None:
        g.sampling_params.max_generate_length = g.max_generate_length
    eval_sp = g.eval_sampling_params
    derive(
        "generator.eval_sampling_params.max_generate_length",
        eval_sp,
        "max_generate_length",
        g.sampling_params.max_generate_length,
    )
    derive("generator.max_input_length", g, "max_input_length", t.max_prompt_length)

    root = default_run_root(t.run_name)
    t.ckpt_path, t.export_path, t.log_dir = _expand(t.ckpt_path), _expand(t.export_path), _expand(t.log_dir)
    t.resume_path = _expand(t.resume_path)
    derive("trainer.ckpt_path", t, "ckpt_path", str(root / "ckpts"))
    derive("trainer.export_path", t, "export_path", str(root / "exports"))
    derive("trainer.log_dir", t, "log_dir", str(root / "logs"))
    t.resume_mode = "none" if t.resume_mode is None else t.resume_mode.strip().lower()

    flag = str(g.override_existing_update_group).strip().lower()
    g.override_existing_update_group = "enable" if flag in _TRUE else "disable" if flag in _FALSE else flag

    cfg.data.train_data = [_expand(p) or p for p in cfg.data.train_data]
    cfg.data.val_data = [_expand(p) or p for p in cfg.data.val_data]
    return derived


def _expand(path: str | None) -> str | None:
    if path is None or not path.startswith("~"):
        return path
    return os.path.expanduser(path)


def validate_config(cfg: SkyliftConfig) -> None:
    """Check value ranges and combinations; raise one ``ConfigError`` listing every problem found."""
    problems: list[str] = []
    for check in _CHECKS:
        check(cfg, problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"invalid configuration ({len(problems)} problem(s)):\n{lines}", problems=problems)


def _one_of(problems: list[str], key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _at_least(problems: list[str], key: str, value: float | int | None, low: float | int) -> None:
    if value is not None and value < low:
        problems.append(f"{key}={value} must be >= {low}")


def _interval(problems: list[str], key: str, value: int, minus_one: str = "to disable") -> None:
    if value != -1 and value < 1:
        problems.append(f"{key}={value} must be >= 1, or -1 {minus_one}")


def _check_batches(cfg: SkyliftConfig, problems: list[str]) -> None:
    t, g = cfg.trainer, cfg.generator
    for name in (
        "train_batch_size",
        "policy_mini_batch_size",
        "critic_mini_batch_size",
        "micro_train_batch_size_per_gpu",
        "micro_forward_batch_size_per_gpu",
        "eval_batch_size",
        "epochs",
        "update_epochs_per_batch",
        "max_prompt_length",
    ):
        _at_least(problems, f"trainer.{name}", getattr(t, name), 1)
    _at_least(problems, "trainer.max_steps", t.max_steps, 1)
    _interval(problems, "trainer.max_tokens_per_microbatch", t.max_tokens_per_microbatch, "for row counts")
    _at_least(problems, "generator.n_samples_per_prompt", g.n_samples_per_prompt, 1)
    _at_least(problems, "generator.eval_n_samples_per_prompt", g.eval_n_samples_per_prompt, 1)
    mini_batch_keys = ["policy_mini_batch_size"]
    if t.algorithm.advantage_estimator == "gae":  # only a critic uses critic_mini_batch_size
        mini_batch_keys.append("critic_mini_batch_size")
    for name in mini_batch_keys:
        mini = getattr(t, name)
        if mini >= 1 and t.train_batch_size >= 1 and t.train_batch_size % mini != 0:
            problems.append(
                f"trainer.train_batch_size={t.train_batch_size} must be divisible by trainer.{name}={mini}"
            )
    world = t.policy_world_size()
    sequences = t.policy_mini_batch_size * g.n_samples_per_prompt
    if world >= 1 and sequences >= 1 and sequences % world != 0:
        problems.append(
            f"policy mini-batch of {sequences} sequences (trainer.policy_mini_batch_size * "
            f"generator.n_samples_per_prompt) must split evenly over {world} policy workers "
            "(trainer.placement.policy_num_nodes * policy_num_gpus_per_node)"
        )
    if t.algorithm.advantage_estimator == "rloo" and g.n_samples_per_prompt < 2:
        problems.append(
            "trainer.algorithm.advantage_estimator=rloo needs generator.n_samples_per_prompt >= 2"
        )


def _check_algorithm(cfg: SkyliftConfig, problems: list[str]) -> None:
    a = cfg.trainer.algorithm
    p = "trainer.algorithm"
    _one_of(problems, f"{p}.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _one_of(problems, f"{p}.policy_loss_type", a.policy_loss_type, POLICY_LOSS_TYPES)
    _one_of(problems, f"{p}.loss_reduction", a.loss_reduction, LOSS_REDUCTIONS)
    _one_of(problems, f"{p}.kl_estimator_type", a.kl_estimator_type, KL_ESTIMATOR_TYPES)
    _one_of(problems, f"{p}.kl_ctrl.type", a.kl_ctrl.type, KL_CTRL_TYPES)
    if a.kl_ctrl.type == "adaptive":
        if not a.use_kl_in_reward:
            problems.append(
                f"{p}.kl_ctrl.type=adaptive controls the KL-in-reward coefficient and needs "
                f"{p}.use_kl_in_reward=true (a KL loss uses kl_loss_coef as it is)"
            )
        if a.kl_ctrl.kl_target <= 0:
            problems.append(f"{p}.kl_ctrl.kl_target={a.kl_ctrl.kl_target} must be > 0")
        _at_least(problems, f"{p}.kl_ctrl.horizon", a.kl_ctrl.horizon, 1)
    if a.use_kl_loss and a.use_kl_in_reward:
        problems.append(f"{p}.use_kl_loss and {p}.use_kl_in_reward are mutually exclusive; enable one")
    for name in ("kl_loss_coef", "eps_clip_low", "eps_clip_high", "value_clip"):
        _at_least(problems, f"{p}.{name}", getattr(a, name), 0)
    _at_least(problems, f"{p}.cispo.cispo_eps_clip_low", a.cispo.cispo_eps_clip_low, 0)
    _at_least(problems, f"{p}.cispo.cispo_eps_clip_high", a.cispo.cispo_eps_clip_high, 0)
    if a.policy_loss_type == "dual_clip" and a.clip_ratio_c <= 1.0:
        problems.append(f"{p}.clip_ratio_c={a.clip_ratio_c} must be > 1 for policy_loss_type=dual_clip")
    for name in ("gamma", "lambd"):
        value = getattr(a, name)
        if not 0.0 <= value <= 1.0:
            problems.append(f"{p}.{name}={value} must be in [0, 1]")
    if a.use_tis and a.tis_imp_ratio_cap <= 0:
        problems.append(f"{p}.use_tis=true needs {p}.tis_imp_ratio_cap > 0 (got {a.tis_imp_ratio_cap})")


def _check_models(cfg: SkyliftConfig, problems: list[str]) -> None:
    t = cfg.trainer
    if not t.policy.model.path:
        problems.append("trainer.policy.model.path must name a model (registry name, directory or Hub id)")
    _one_of(problems, "trainer.strategy", t.strategy, STRATEGIES)
    for role in ("policy", "critic"):
        _check_optimizer(getattr(t, role).optimizer_config, f"trainer.{role}.optimizer_config", problems)
    lora = t.policy.model.lora
    _at_least(problems, "trainer.policy.model.lora.rank", lora.rank, 0)
    if lora.rank > 0 and lora.alpha <= 0:
        problems.append(f"trainer.policy.model.lora.alpha={lora.alpha} must be > 0 when LoRA is on")
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"trainer.policy.model.lora.dropout={lora.dropout} must be in [0, 1)")
    pl = t.placement
    for name in (
        "policy_num_nodes",
        "policy_num_gpus_per_node",
        "ref_num_nodes",
        "ref_num_gpus_per_node",
        "critic_num_nodes",
        "critic_num_gpus_per_node",
    ):
        _at_least(problems, f"trainer.placement.{name}", getattr(pl, name), 1)


def _check_optimizer(opt: OptimizerConfig, prefix: str, problems: list[str]) -> None:
    if opt.lr <= 0:
        problems.append(f"{prefix}.lr={opt.lr} must be > 0")
    if len(opt.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in opt.adam_betas):
        problems.append(f"{prefix}.adam_betas={opt.adam_betas} must be two numbers in [0, 1)")
    _at_least(problems, f"{prefix}.weight_decay", opt.weight_decay, 0)
    _at_least(problems, f"{prefix}.num_warmup_steps", opt.num_warmup_steps, 0)
    _one_of(problems, f"{prefix}.scheduler", opt.scheduler, LR_SCHEDULERS)


def _check_schedule(cfg: SkyliftConfig, problems: list[str]) -> None:
    t = cfg.trainer
    _interval(problems, "trainer.eval_interval", t.eval_interval)
    _interval(problems, "trainer.ckpt_interval", t.ckpt_interval)
    _interval(problems, "trainer.hf_save_interval", t.hf_save_interval)
    _interval(problems, "trainer.max_ckpts_to_keep", t.max_ckpts_to_keep, "to keep all")
    _one_of(problems, "trainer.resume_mode", t.resume_mode, RESUME_MODES)
    if t.resume_mode == "from_path" and not t.resume_path:
        problems.append("trainer.resume_mode=from_path needs trainer.resume_path")
    loggers = t.loggers()
    if not loggers:
        problems.append("trainer.logger must name at least one tracker")
    for name in loggers:
        _one_of(problems, "trainer.logger", name, LOGGERS)
    if not t.run_name.strip():
        problems.append("trainer.run_name must not be empty")
    _at_least(problems, "trainer.max_staleness_steps", t.max_staleness_steps, 1)
    _one_of(problems, "trainer.placement.backend", t.placement.backend, PLACEMENT_BACKENDS)
    if t.placement.backend == "local" and (
        t.policy_world_size() > 1 or t.placement.ref_num_nodes * t.placement.ref_num_gpus_per_node > 1
    ):
        problems.append(
            "trainer.placement.backend=local runs one policy and one reference worker in this process; "
            "use backend=ray for several workers"
        )
    if t.async_training and t.placement.colocate_all:
        problems.append(
            "trainer.async_training=true overlaps generation and training and cannot run with "
            "trainer.placement.colocate_all=true"
        )


def _check_generator(cfg: SkyliftConfig, problems: list[str]) -> None:
    g = cfg.generator
    _one_of(problems, "generator.backend", g.backend, INFERENCE_BACKENDS)
    _one_of(problems, "generator.model_dtype", g.model_dtype, MODEL_DTYPES)
    _one_of(problems, "generator.weight_sync_backend", g.weight_sync_backend, WEIGHT_SYNC_BACKENDS)
    _one_of(
        problems,
        "generator.override_existing_update_group",
        g.override_existing_update_group,
        UPDATE_GROUP_OVERRIDES,
    )
    _at_least(problems, "generator.num_inference_engines", g.num_inference_engines, 1)
    _at_least(
        problems,
        "generator.inference_engine_tensor_parallel_size",
        g.inference_engine_tensor_parallel_size,
        1,
    )
    _at_least(problems, "generator.max_num_seqs", g.max_num_seqs, 1)
    _at_least(problems, "generator.max_num_batched_tokens", g.max_num_batched_tokens, 1)
    _at_least(problems, "generator.max_turns", g.max_turns, 1)
    _at_least(problems, "generator.max_input_length", g.max_input_length, 1)
    _at_least(problems, "generator.max_generate_length", g.max_generate_length, 1)
    if g.kv_cache_gb is not None and g.kv_cache_gb <= 0:
        problems.append(f"generator.kv_cache_gb={g.kv_cache_gb} must be > 0 (GiB of KV cache per engine)")
    if not 0.0 < g.gpu_memory_utilization <= 1.0:
        problems.append(f"generator.gpu_memory_utilization={g.gpu_memory_utilization} must be in (0, 1]")
    for key in ("http_timeout_s", "engine_startup_timeout_s", "weight_sync_timeout_s"):
        if getattr(g, key) <= 0:
            problems.append(f"generator.{key}={getattr(g, key)} must be > 0")
    for key in ("worker_timeout_s", "collective_timeout_s"):
        if getattr(cfg.trainer, key) <= 0:
            problems.append(f"trainer.{key}={getattr(cfg.trainer, key)} must be > 0")
    if g.batched and g.max_turns > 1:
        problems.append(
            "generator.batched=true supports only max_turns=1; set generator.batched=false for multi-turn"
        )
    if not g.run_engines_locally:
        if not g.remote_inference_engine_urls:
            problems.append(
                "generator.run_engines_locally=false needs generator.remote_inference_engine_urls "
                "(e.g. \"['127.0.0.1:8001']\")"
            )
        for url in g.remote_inference_engine_urls:
            if not _valid_url(url):
                problems.append(
                    f"generator.remote_inference_engine_urls: {url!r} is not host:port or http(s)://host:port"
                )
    _check_sampling(g.sampling_params, "generator.sampling_params", problems)
    _check_sampling(g.eval_sampling_params, "generator.eval_sampling_params", problems)


def _valid_url(url: str) -> bool:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None


def _check_sampling(sp: SamplingParams, prefix: str, problems: list[str]) -> None:
    _at_least(problems, f"{prefix}.max_generate_length", sp.max_generate_length, 1)
    _at_least(problems, f"{prefix}.temperature", sp.temperature, 0)
    if not 0.0 < sp.top_p <= 1.0:
        problems.append(f"{prefix}.top_p={sp.top_p} must be in (0, 1]")
    if sp.top_k < -1:
        problems.append(f"{prefix}.top_k={sp.top_k} must be -1 (all tokens) or >= 0")
    if not 0.0 <= sp.min_p <= 1.0:
        problems.append(f"{prefix}.min_p={sp.min_p} must be in [0, 1]")
    if sp.repetition_penalty <= 0:
        problems.append(f"{prefix}.repetition_penalty={sp.repetition_penalty} must be > 0")
    _at_least(problems, f"{prefix}.logprobs", sp.logprobs, 0)


def _check_data(cfg: SkyliftConfig, problems: list[str]) -> None:
    d = cfg.data
    if not d.train_data:
        problems.append("data.train_data must list at least one file")
    for key, paths in (("data.train_data", d.train_data), ("data.val_data", d.val_data)):
        if any(not p.strip() for p in paths):
            problems.append(f"{key} contains an empty path")
    _at_least(problems, "data.max_train_samples", d.max_train_samples, 1)
    _at_least(problems, "data.max_val_samples", d.max_val_samples, 1)
    if not cfg.environment.env_class.strip():
        problems.append("environment.env_class must name an environment")
    _at_least(problems, "environment.max_env_workers", cfg.environment.max_env_workers, 0)


_CHECKS: tuple[Callable[[SkyliftConfig, list[str]], None], ...] = (
    _check_batches,
    _check_algorithm,
    _check_models,
    _check_schedule,
    _check_generator,
    _check_data,
)
