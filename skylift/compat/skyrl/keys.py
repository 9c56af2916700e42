"""SkyRL's command lines and config files on skylift: its other key names, its refused backends,
and the settings that map onto several skylift keys (the loader's SkyRL dialect,
`skylift.config.dialects`).

``load_config`` hands every assignment to `SkyRLKeys.take` before the schema sees it:

- a Megatron key (``*.megatron_config.*``) or ``trainer.strategy=megatron`` / ``deepspeed`` stops the
  load with `backend_refusal` (checked over the whole command line first, so that it is the one
  message a Megatron command gets);
- a SkyRL key declared without effect (``skylift.compat.skyrl.unused_keys.SKYRL_WITHOUT_EFFECT``)
  is set aside and warned about when its value is not SkyRL's default; one declared not
  implemented (``unused_keys.SKYRL_NOT_IMPLEMENTED``) is refused when set to anything but its
  default; a key only SkyRL's example generators read is refused naming the example;
- ``generator.inference_engine.{external_proxy_url,external_server_urls}`` are collected and turned
  into skylift's keys by `SkyRLKeys.translations` once every assignment is in; so are
  ``generator.miniswe_config_path`` / ``miniswe_traj_dir`` (SkyRL's mini-SWE-agent example): the
  agent then runs on the gateway (``environment.harness``, `skylift.integrations.mini_swe_agent.harness`), with
  mini-SWE-agent's LocalEnvironment when Docker is absent (one warning says so).

``trainer.algorithm.off_policy_correction.*`` is a group of skylift's schema (config/algorithm.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from skylift.compat.skyrl.unused_keys import is_default, skyrl_declaration, skyrl_example_generator
from skylift.config.dialects import DIALECTS
from skylift.config.errors import ConfigError

logger = logging.getLogger("skylift.config")

# Keys of newer SkyRL releases (generator.inference_engine.*) mapped to the seed's flat keys.
_ENGINE_ALIASES = {
    "run_engines_locally": "run_engines_locally",
    "remote_urls": "remote_inference_engine_urls",
    "num_engines": "num_inference_engines",
    "tensor_parallel_size": "inference_engine_tensor_parallel_size",
    "backend": "backend",
    "model_dtype": "model_dtype",
    "weight_sync_backend": "weight_sync_backend",
    "async_engine": "async_engine",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "enforce_eager": "enforce_eager",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "override_existing_update_group": "override_existing_update_group",
    "delta_weight_sync": "delta_weight_sync",
    "enable_return_routed_experts": "enable_return_routed_experts",
}

#: SkyRL's other names of skylift keys (both layouts).
SKYRL_KEY_ALIASES: dict[str, str] = {
    **{f"generator.inference_engine.{old}": f"generator.{new}" for old, new in _ENGINE_ALIASES.items()},
    "trainer.use_sample_packing": "trainer.remove_microbatch_padding",
    "trainer.max_training_steps": "trainer.max_steps",
    "environment.skyrl_gym.max_env_workers": "environment.max_env_workers",
    "environment.skyrl_gym": "environment.env_configs",
    "generator.inference_engine.engine_init_kwargs": "generator.engine_init_kwargs",
    "trainer.algorithm.overlong_buffer_len": "trainer.algorithm.overlong_buffer.len",
    "trainer.algorithm.overlong_buffer_penalty_factor": "trainer.algorithm.overlong_buffer.penalty_factor",
}

#: SkyRL values skylift reads as another value of the same key: key -> {SkyRL value: (skylift value, why)}.
VALUE_ALIASES: dict[str, dict[Any, tuple[Any, str | None]]] = {
    "trainer.strategy": {"fsdp": ("fsdp2", None)},  # SkyRL's name for FSDP2 since it dropped FSDP1
    "trainer.algorithm.loss_reduction": {
        "token_mean_legacy": (
            "token_mean",
            "skylift's token_mean divides by the mini-batch's token count; SkyRL's former "
            "per-micro-batch average is not implemented",
        )
    },
}

REFUSED_STRATEGIES = {"megatron": "Megatron", "deepspeed": "DeepSpeed"}

_MINISWE = ("generator.miniswe_config_path", "generator.miniswe_traj_dir")
_COLLECTED = {
    "generator.inference_engine.external_proxy_url",
    "generator.inference_engine.external_server_urls",
    *_MINISWE,
}


def docker_available(timeout_s: float = 10.0) -> bool:
    """Whether Docker runs here: a ``docker`` command on PATH whose daemon answers (mini-SWE-agent's
    Docker environment needs both)."""
    import shutil
    import subprocess

    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def miniswe_translations(config_path: Any, traj_dir: Any) -> list[tuple[str, Any]]:
    """SkyRL's mini-SWE-agent example keys as the gateway harness running mini-SWE-agent."""
    h = "environment.harness."
    out: list[tuple[str, Any]] = [
        (h + "entrypoint", "skylift.integrations.mini_swe_agent.harness:run"),
        (h + "verifier", "skylift.integrations.mini_swe_agent.harness:verify"),
        (h + "options.config", str(config_path)),
        # the example sets generator.batched=true only to reach its generator's generate_batched;
        # the harness drives each rollout itself (batched, single-turn generation does not apply)
        ("generator.batched", False),
    ]
    if traj_dir:
        out.append((h + "options.traj_dir", str(traj_dir)))
    if not docker_available():
        out.append((h + "options.environment", "local"))
        logger.warning(
            "generator.miniswe_config_path: SkyRL's mini-SWE-agent example runs on skylift's gateway "
            "(environment.harness, skylift.integrations.mini_swe_agent.harness) with mini-swe-agent's LocalEnvironment, not "
            "in the instances' Docker containers: Docker is absent (no docker daemon answers), so the agent's "
            "commands and the eval scripts run on this machine in each rollout's working directory"
        )
    return out


def backend_refusal(key: str, value: Any = None) -> str | None:
    """The one message for a key of a training backend skylift does not have, or None."""
    parts = key.split(".")
    if any(part.startswith("megatron") for part in parts):
        name, what = "Megatron", key
    elif key == "trainer.strategy" and str(value).lower() in REFUSED_STRATEGIES:
        name, what = REFUSED_STRATEGIES[str(value).lower()], f"{key}={value}"
    else:
        return None
    return (
        f"skylift has no {name} backend ({what} is refused): it trains with FSDP2 only "
        "(trainer.strategy=fsdp or fsdp2). For large models it offers LoRA "
        "(trainer.policy.model.lora.rank), CPU offload (trainer.policy.fsdp_config.cpu_offload), "
        "more FSDP2 workers (trainer.placement.policy_num_nodes / policy_num_gpus_per_node) and "
        "tensor-parallel inference engines (generator.inference_engine.tensor_parallel_size)"
    )


def refuse_backends(assignments: Iterable[tuple[str, Any]]) -> None:
    """Raise the backend refusal for the first Megatron or DeepSpeed assignment, if any."""
    for key, value in assignments:
        message = backend_refusal(key.lstrip("+"), value)
        if message is not None:
            raise ConfigError(message, key=key.lstrip("+"))


@DIALECTS.register
@dataclass
class SkyRLKeys:
    """The SkyRL-only settings of one load: set aside (no effect) or waiting for `translations`."""

    ALIASES: ClassVar[dict[str, str]] = SKYRL_KEY_ALIASES
    TRANSLATION_SOURCE: ClassVar[str] = "SkyRL's external server or mini-SWE-agent keys"
    #: what SkyRL's YAML file always sets these keys to (read only with LoRA on), so validation does
    #: not take it for the user's choice (`skylift.config.validation.dialect_file_default`)
    FILE_DEFAULTS: ClassVar[dict[str, Any]] = {
        "generator.lora_sync_path": "/tmp/skyrl_lora_sync",
        "trainer.policy.model.lora.lora_sync_path": "/tmp/skyrl_lora_sync",
    }

    without_effect: dict[str, Any] = field(default_factory=dict)
    collected: dict[str, Any] = field(default_factory=dict)

    def refuse(self, assignments: Iterable[tuple[str, Any]]) -> None:
        """The backend refusal for the first Megatron or DeepSpeed assignment, if any."""
        refuse_backends(assignments)

    def unknown_key(self, key: str, source: str) -> str | None:
        """The refusal of a key only one of SkyRL's example generators reads, or None."""
        example = skyrl_example_generator(key)
        if example is None:
            return None
        return (
            f"{key} (from {source}) is read only by {example}; skylift does not run that example's own "
            "generator (skylift's multi-turn agents with tools: docs/agentic.md)"
        )

    def value(self, key: str, value: Any) -> Any:
        """The skylift value of a SkyRL value (`VALUE_ALIASES`), warning when they differ in meaning."""
        alias = VALUE_ALIASES.get(key, {}).get(value) if isinstance(value, str) else None
        if alias is None:
            return value
        if alias[1] is not None:
            logger.warning("%s=%s is read as %s: %s", key, value, alias[0], alias[1])
        return alias[0]

    def take(self, key: str, value: Any, source: str) -> bool:
        """Whether ``key=value`` is a SkyRL-only setting handled here (else the schema takes it)."""
        message = backend_refusal(key, value)
        if message is not None:
            raise ConfigError(f"{message} (from {source})", key=key)
        if key in _COLLECTED:
            self.collected[key] = value
            return True
        declared = skyrl_declaration(key)
        if declared is None:
            return False
        default, reason, refused = declared
        if refused and not is_default(value, default):
            raise ConfigError(
                f"{key}={value!r} is not implemented in skylift yet ({reason}); leave it at "
                f"{default!r} (from {source})",
                key=key,
            )
        self.without_effect[key] = value
        return True

    def translations(self) -> list[tuple[str, Any]]:
        """The skylift assignments the collected SkyRL settings stand for."""
        out: list[tuple[str, Any]] = []
        c = self.collected
        ie = "generator.inference_engine."
        servers, proxy = c.get(ie + "external_server_urls"), c.get(ie + "external_proxy_url")
        if isinstance(servers, str):
            servers = [servers]
        servers = [url for url in servers or () if url]  # key= is "" (Hydra): unset, as SkyRL reads it
        proxy = proxy or None
        if servers or proxy:
            out.append(("generator.run_engines_locally", False))
            out.append(("generator.remote_inference_engine_urls", list(servers) if servers else [proxy]))
        if c.get(_MINISWE[0]):
            out += miniswe_translations(c[_MINISWE[0]], c.get(_MINISWE[1]))
        elif c.get(_MINISWE[1]):
            raise ConfigError(
                f"{_MINISWE[1]} is set without {_MINISWE[0]} (the mini-SWE-agent config to run)",
                key=_MINISWE[1],
            )
        if servers and proxy:
            logger.warning(
                "%sexternal_proxy_url=%r is not used: skylift sends generation requests straight to "
                "the servers of external_server_urls (balancing them itself) and weight syncs to each",
                ie,
                proxy,
            )
        return out

    def warn(self) -> list[str]:
        """Warn once per SkyRL key set aside with a value other than SkyRL's default; returns them."""
        warned = []
        for key, value in self.without_effect.items():
            declared = skyrl_declaration(key)
            assert declared is not None
            default, reason = declared[0], declared[1]
            if not is_default(value, default):
                logger.warning("%s=%r has no effect in skylift: %s", key, value, reason)
                warned.append(key)
        return warned
