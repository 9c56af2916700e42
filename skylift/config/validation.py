"""Derived defaults (``finalize``) and semantic checks (``validate_config``) of a ``SkyliftConfig``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skylift.config.algorithm import ADVANTAGE_ESTIMATORS, POLICY_LOSS_TYPES, AlgorithmConfig
from skylift.config.delta_sync import delta_problems
from skylift.config.dialects import DIALECTS
from skylift.config.errors import ConfigError
from skylift.config.harness import harness_problems
from skylift.config.schema import PLACEMENT_BACKENDS, SkyliftConfig
from skylift.utils.plugins import PluginImportError, import_user_modules
from skylift.utils.registry import ADVANTAGE_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

_TRUE = {"true", "yes", "on", "1", "enable", "enabled"}
_FALSE = {"false", "no", "off", "0", "disable", "disabled"}


def overrides_update_group(value: str | bool) -> bool:
    """Whether ``generator.override_existing_update_group`` replaces an existing group: ``auto`` and yes-words do."""
    return str(value).strip().lower() in _TRUE | {"auto"}


def default_runs_dir() -> str:
    """``trainer.runs_dir`` when null: ``$SKYLIFT_RUNS_DIR`` if set, else ``~/skylift/runs``."""
    root = os.environ.get("SKYLIFT_RUNS_DIR")
    return str(Path(root).expanduser() if root else Path.home() / "skylift" / "runs")


def default_run_root(run_name: str, runs_dir: str | None = None) -> Path:
    """Where a run's checkpoints, exports and logs go unless configured: ``<runs_dir>/<run_name>``
    (an empty run name, as ``trainer.run_name=`` gives it, is the default name ``skylift_run``)."""
    return Path(runs_dir or default_runs_dir()).expanduser() / (run_name.strip() or "skylift_run")


def finalize(cfg: SkyliftConfig) -> dict[str, Any]:
    """Fill in derived defaults in place (idempotent); return {dotted key: value} of keys derived from null.

    - ``trainer.ref.model.path`` null -> the policy's path; ``trainer.critic.model.path`` null with
      ``advantage_estimator=gae`` -> the policy's path.
    - ``generator.max_generate_length``, when set, wins over ``generator.sampling_params.max_generate_length``;
      ``generator.eval_sampling_params.max_generate_length`` null -> the training value.
    - ``generator.max_input_length`` null -> ``trainer.max_prompt_length``.
    - ``trainer.ckpt_path`` / ``export_path`` / ``log_dir`` null -> ``<runs_dir>/<run_name>/{ckpts,exports,logs}``
      (``trainer.runs_dir`` null: ``$SKYLIFT_RUNS_DIR``, else ``~/skylift/runs``).
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

    t.runs_dir = _expand(t.runs_dir)
    root = default_run_root(t.run_name, t.runs_dir)
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
    """Check every field's `Bounds` (declared beside the field in ``schema.py``) and the combinations
    of keys below; raise one ``ConfigError`` listing every problem found."""
    problems: list[str] = []
    _check_bounds(cfg, "", problems)
    for check in _CHECKS:
        check(cfg, problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"invalid configuration ({len(problems)} problem(s)):\n{lines}", problems=problems)


def _check_bounds(node: Any, prefix: str, problems: list[str]) -> None:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_bounds(value, f"{prefix}{f.name}.", problems)
        elif (bounds := f.metadata.get("bounds")) is not None:
            problem = bounds.problem(f"{prefix}{f.name}", value)
            if problem is not None:
                problems.append(problem)


def _one_of(problems: list[str], key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _at_least(problems: list[str], key: str, value: float | int | None, low: float | int) -> None:
    if value is not None and value < low:
        problems.append(f"{key}={value} must be >= {low}")


def _check_batches(cfg: SkyliftConfig, problems: list[str]) -> None:
    t, g = cfg.trainer, cfg.generator
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
    workers = f"{world} policy workers (trainer.placement.policy_num_nodes * policy_num_gpus_per_node)"
    if world >= 1 and sequences >= 1 and sequences < world:
        # a mini-batch that is not a multiple of the workers is padded with rows without loss
        # (skylift.rl.update.pad_rows); fewer rows than workers would be mostly padding
        problems.append(
            f"policy mini-batch of {sequences} sequences (trainer.policy_mini_batch_size * "
            f"generator.n_samples_per_prompt) must hold at least one sequence for each of the {workers}"
        )
    batch = t.train_batch_size * g.n_samples_per_prompt
    if world >= 1 and batch >= 1 and batch % world != 0:
        problems.append(
            f"training batch of {batch} sequences (trainer.train_batch_size * generator.n_samples_per_prompt) "
            f"must split evenly over the {workers}: every worker runs the same forward passes"
        )
    if t.algorithm.advantage_estimator == "rloo" and g.n_samples_per_prompt < 2:
        problems.append(
            "trainer.algorithm.advantage_estimator=rloo needs generator.n_samples_per_prompt >= 2"
        )


def _check_loss_settings(a: AlgorithmConfig, problems: list[str]) -> None:
    """The clip_cov bounds and the off-policy corrections (skylift.algorithms.off_policy)."""
    p = "trainer.algorithm"
    if a.clip_cov.clip_cov_lb >= a.clip_cov.clip_cov_ub:
        problems.append(
            f"{p}.clip_cov.clip_cov_lb={a.clip_cov.clip_cov_lb} must be < "
            f"{p}.clip_cov.clip_cov_ub={a.clip_cov.clip_cov_ub}"
        )
    o, q = a.off_policy_correction, f"{p}.off_policy_correction"
    if a.use_tis and o.tis_ratio_type is not None:
        problems.append(
            f"{p}.use_tis=true and {q}.tis_ratio_type={o.tis_ratio_type!r} both ask for truncated "
            f"importance sampling; set one (use_tis is token-level TIS with cap {p}.tis_imp_ratio_cap)"
        )
    if (o.token_mask_is_threshold_low is None) != (o.token_mask_is_threshold_high is None):
        problems.append(
            f"{q}.token_mask_is_threshold_low and token_mask_is_threshold_high must be set together "
            "(the token mask keeps tokens whose ratio lies between them)"
        )
    for name, low, high in (
        ("geo_mask", o.geo_mask_low, o.geo_mask_high),
        ("product_mask", o.product_mask_low, o.product_mask_high),
        ("token_mask_is_threshold", o.token_mask_is_threshold_low, o.token_mask_is_threshold_high),
        ("outlier_token_is_threshold", o.outlier_token_is_threshold_low, o.outlier_token_is_threshold_high),
    ):
        if low is not None and high is not None and low > high:
            problems.append(f"{q}.{name}_low={low} must be <= {q}.{name}_high={high}")


def _check_algorithm(cfg: SkyliftConfig, problems: list[str]) -> None:
    a = cfg.trainer.algorithm
    p = "trainer.algorithm"
    _check_algorithm_names(a, problems)
    if a.kl_ctrl.type == "adaptive" and not a.use_kl_in_reward:
        problems.append(
            f"{p}.kl_ctrl.type=adaptive controls the KL-in-reward coefficient and needs "
            f"{p}.use_kl_in_reward=true (a KL loss uses kl_loss_coef as it is)"
        )
    if a.on_policy_distillation and not a.use_kl_in_reward:
        problems.append(
            f"{p}.on_policy_distillation=true replaces the KL-in-reward step and needs "
            f"{p}.use_kl_in_reward=true"
        )
    if a.on_policy_distillation and a.kl_ctrl.type == "adaptive":
        problems.append(
            f"{p}.kl_ctrl.type=adaptive has nothing to control with {p}.on_policy_distillation=true "
            "(the teacher's log-ratio is the whole reward, coefficient 1)"
        )
    if a.use_kl_loss and a.use_kl_in_reward:
        problems.append(f"{p}.use_kl_loss and {p}.use_kl_in_reward are mutually exclusive; enable one")
    if a.policy_loss_type == "dual_clip" and a.clip_ratio_c <= 1.0:
        problems.append(f"{p}.clip_ratio_c={a.clip_ratio_c} must be > 1 for policy_loss_type=dual_clip")
    if a.use_tis and a.tis_imp_ratio_cap <= 0:
        problems.append(f"{p}.use_tis=true needs {p}.tis_imp_ratio_cap > 0 (got {a.tis_imp_ratio_cap})")
    _check_loss_settings(a, problems)
    buffer, budget = a.overlong_buffer.len, cfg.generator.sampling_params.max_generate_length
    if buffer > budget:
        problems.append(
            f"{p}.overlong_buffer.len={buffer} must be <= the response budget max_generate_length={budget}"
        )
    size, batch = a.dynamic_sampling.gen_batch_size, cfg.trainer.train_batch_size
    key = f"{p}.dynamic_sampling.gen_batch_size={size}"
    if size != -1 and a.dynamic_sampling.type is None:
        problems.append(f"{key} oversamples for dynamic sampling and needs {p}.dynamic_sampling.type set")
    elif size != -1 and size < batch:
        problems.append(f"{key} must be >= trainer.train_batch_size={batch}")


def _check_algorithm_names(a: AlgorithmConfig, problems: list[str]) -> None:
    """The estimator and the loss are built in or registered by a module of ``import_modules``
    (imported here, so that a misspelt name or a broken module fails before anything starts)."""
    p = "trainer.algorithm"
    names = (
        ("advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_REGISTRY),
        ("policy_loss_type", a.policy_loss_type, POLICY_LOSS_TYPES, POLICY_LOSS_REGISTRY),
    )
    if all(value in builtin for _, value, builtin, _ in names):
        return
    if a.import_modules:
        try:
            import_user_modules(a.import_modules, f"{p}.import_modules")
        except PluginImportError as exc:
            problems.append(str(exc))
            return
    for key, value, builtin, registry in names:
        if value in builtin or value in registry:
            continue
        if a.import_modules:
            extra = sorted(set(registry.names()) - set(builtin))
            hint = f"; {p}.import_modules registered {', '.join(extra) if extra else 'no ' + registry.kind}"
        else:
            hint = f"; for a custom {registry.kind}, list the module that registers it in {p}.import_modules"
        problems.append(f"{p}.{key}={value!r} is not one of {', '.join(builtin)}{hint}")


def dialect_file_default(key: str, value: Any) -> bool:
    """Whether `value` is what a registered config dialect's files always set `key` to
    (`FILE_DEFAULTS` of a dialect, `skylift.config.dialects`)."""
    return any(
        key in defaults and defaults[key] == value
        for defaults in (getattr(make, "FILE_DEFAULTS", {}) for make in DIALECTS.items())
    )


def _check_models(cfg: SkyliftConfig, problems: list[str]) -> None:
    t = cfg.trainer
    if not t.policy.model.path:
        problems.append("trainer.policy.model.path must name a model (registry name, directory or Hub id)")
    for role in ("policy", "critic"):
        betas = getattr(t, role).optimizer_config.adam_betas
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            problems.append(
                f"trainer.{role}.optimizer_config.adam_betas={betas} must be two numbers in [0, 1)"
            )
    p = t.placement
    for role, world in (
        ("policy", t.policy_world_size()),
        ("ref", p.ref_num_nodes * p.ref_num_gpus_per_node),
        ("critic", p.critic_num_nodes * p.critic_num_gpus_per_node),
    ):
        size = getattr(t, role).fsdp_config.fsdp_size
        if size == 0 or size < -1 or 0 < size < world and world % size:
            problems.append(
                f"trainer.{role}.fsdp_config.fsdp_size={size} must be -1 (shard over all ranks) or a "
                f"size of shard groups that divides the {role}'s {world} workers"
            )
        sp = getattr(t, role).sequence_parallel_size
        if sp > 1 and world % sp:
            problems.append(
                f"trainer.{role}.sequence_parallel_size={sp} must divide the {role}'s {world} workers "
                f"(trainer.placement.{role}_num_nodes x {role}_num_gpus_per_node)"
            )
    for role in ("policy", "critic"):
        adapter = getattr(t, role).model.lora
        if adapter.rank > 0 and adapter.alpha <= 0:
            problems.append(f"trainer.{role}.model.lora.alpha={adapter.alpha} must be > 0 when LoRA is on")
    lora = t.policy.model.lora
    sync_paths = {
        key: path
        for key, path in (
            ("generator.lora_sync_path", cfg.generator.lora_sync_path),
            ("trainer.policy.model.lora.lora_sync_path", lora.lora_sync_path),
        )
        if path
    }
    if len(set(sync_paths.values())) > 1:
        problems.append(
            "generator.lora_sync_path and trainer.policy.model.lora.lora_sync_path (two names of "
            f"the same setting) name different directories ({sync_paths['generator.lora_sync_path']!r} "
            f"and {sync_paths['trainer.policy.model.lora.lora_sync_path']!r}): set one of them"
        )
    for key, path in sync_paths.items():
        # a value a dialect's config files always set (read only with LoRA on) is not the user's choice
        if lora.rank == 0 and not dialect_file_default(key, path):
            problems.append(
                f"{key}={path!r} hands a LoRA adapter to the engines, but trainer.policy.model.lora.rank "
                "is 0 (the full weights go over the weight-update group): set a LoRA rank or drop "
                "lora_sync_path"
            )
    if lora.rank > 512:
        problems.append(f"trainer.policy.model.lora.rank={lora.rank}: vLLM serves LoRA ranks up to 512")
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


def _check_schedule(cfg: SkyliftConfig, problems: list[str]) -> None:
    t = cfg.trainer
    if t.resume_mode == "from_path" and not t.resume_path:
        problems.append("trainer.resume_mode=from_path needs trainer.resume_path")
    if not t.loggers():
        problems.append("trainer.logger must name at least one tracker")
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
    problems += delta_problems(g.weight_sync_backend, g.delta_weight_sync, cfg.trainer.policy.model.lora.rank)
    problems += harness_problems(cfg.environment.harness)
    if cfg.generator.merge_stepwise_output and not cfg.generator.step_wise_trajectories:
        problems.append("generator.merge_stepwise_output=true needs generator.step_wise_trajectories=true")
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
    for group in ("sampling_params", "eval_sampling_params"):
        top_k = getattr(g, group).top_k
        if top_k < -1:
            problems.append(f"generator.{group}.top_k={top_k} must be -1 (all tokens) or >= 0")


def _check_fully_async(cfg: SkyliftConfig, problems: list[str]) -> None:
    t = cfg.trainer
    fa, p = t.fully_async, "trainer.fully_async"
    if fa.sample_full_batch and not (fa.enabled and t.algorithm.zero_variance_filter):
        problems.append(
            f"{p}.sample_full_batch=true drops zero-variance groups in fully async runs: it needs "
            f"{p}.enabled=true and trainer.algorithm.zero_variance_filter=true"
        )
    if not fa.enabled:
        return
    if t.async_training:
        problems.append(
            f"{p}.enabled=true and trainer.async_training=true are mutually exclusive; enable one"
        )
    if t.placement.colocate_all:
        problems.append(
            f"{p}.enabled=true generates while training and cannot run with trainer.placement.colocate_all=true"
        )
    if not (t.algorithm.corrects_off_policy or t.algorithm.policy_loss_type in ("rollout_is", "dppo")):
        problems.append(
            f"{p}.enabled=true needs a correction of the rollouts' staleness: trainer.algorithm.use_tis=true "
            "(and tis_imp_ratio_cap > 0), a trainer.algorithm.off_policy_correction "
            "(tis_ratio_type or sequence_mask_metric, ...), or policy_loss_type=rollout_is or dppo"
        )
    if t.algorithm.dynamic_sampling.type is not None:
        problems.append(
            f"{p}.enabled=true does not run with trainer.algorithm.dynamic_sampling.type set (its filter, "
            f"fully async: {p}.sample_full_batch=true with trainer.algorithm.zero_variance_filter=true)"
        )
    workers, batch = fa.num_parallel_generation_workers, t.train_batch_size
    if workers is not None and not batch <= workers <= batch * (fa.max_staleness_steps + 1):
        problems.append(
            f"{p}.num_parallel_generation_workers={workers} must be in [train_batch_size, train_batch_size * "
            f"(max_staleness_steps + 1)] = [{batch}, {batch * (fa.max_staleness_steps + 1)}]"
        )


def _valid_url(url: str) -> bool:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None


def _check_data(cfg: SkyliftConfig, problems: list[str]) -> None:
    d = cfg.data
    if not d.train_data:
        problems.append("data.train_data must list at least one file")
    for key, paths in (("data.train_data", d.train_data), ("data.val_data", d.val_data)):
        if any(not p.strip() for p in paths):
            problems.append(f"{key} contains an empty path")
    if not cfg.environment.env_class.strip():
        problems.append("environment.env_class must name an environment")
    url = cfg.environment.llm_base_url
    if url is not None and (not url.startswith(("http://", "https://")) or not _valid_url(url)):
        problems.append(f"environment.llm_base_url={url!r} must be an http(s)://host:port URL")


_CHECKS: tuple[Callable[[SkyliftConfig, list[str]], None], ...] = (
    _check_batches,
    _check_algorithm,
    _check_models,
    _check_schedule,
    _check_generator,
    _check_fully_async,
    _check_data,
)
