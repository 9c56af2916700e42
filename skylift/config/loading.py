"""Building a validated ``SkyliftConfig`` from defaults, an optional YAML file and dotlist overrides.

OmegaConf does the parsing (YAML values, ``"['a', 'b']"`` lists, ``true/True/false``, null,
``${...}`` interpolations) and the type checks against the dataclass schema; this module checks
keys itself first so that every error names the full key and suggests a valid one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skylift.config.errors import ConfigError
from skylift.config.formatting import set_derived_keys
from skylift.config.inert import skyrl_example_generator, warn_without_effect
from skylift.config.keys import is_list_type, key_table, mapping_leaf_of, suggest_keys, type_name
from skylift.config.schema import SkyliftConfig
from skylift.config.skyrl import SKYRL_KEY_ALIASES, SkyRLKeys, refuse_backends
from skylift.config.validation import finalize, validate_config

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
}
KEY_ALIASES: dict[str, str] = {
    **{f"generator.inference_engine.{old}": f"generator.{new}" for old, new in _ENGINE_ALIASES.items()},
    **SKYRL_KEY_ALIASES,
}
_HYDRA_KEYS = ("defaults", "hydra")  # a Hydra config file's own entries, not settings


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> SkyliftConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``key.sub=value``), validated.

    Returns real dataclass instances with derived defaults filled in (see
    ``skylift.config.validation.finalize``); a key of ``skylift.config.inert.WITHOUT_EFFECT`` set to
    a non-default value logs a warning naming it, and so does a SkyRL key declared without effect
    (``inert.SKYRL_WITHOUT_EFFECT``; see ``skylift.config.skyrl``). Raises ``ConfigError`` on an
    unknown key (with the closest valid key), a value of the wrong type, a malformed override, an
    invalid combination, or a backend skylift does not have (Megatron, DeepSpeed).
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    cfg = OmegaConf.structured(SkyliftConfig)
    skyrl = SkyRLKeys()
    file_items = list(_file_assignments(Path(config_file))) if config_file is not None else []
    parsed = [(override, *parse_override(override)) for override in overrides]
    refuse_backends([*file_items, *((key, value) for _, key, value in parsed)])
    for key, value in file_items:
        _assign(cfg, key, value, str(config_file), skyrl)
    for override, key, value in parsed:
        _assign(cfg, key, value, f"override {override!r}", skyrl)
    for key, value in skyrl.translations():
        _assign(cfg, key, value, "SkyRL's external server keys", skyrl)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(
            f"cannot resolve {key or 'the configuration'}: {_first_line(exc)}", key=key
        ) from exc
    assert isinstance(obj, SkyliftConfig)
    derived = finalize(obj)
    validate_config(obj)
    set_derived_keys(obj, derived)
    warn_without_effect(obj)
    skyrl.warn()
    return obj


def default_config() -> SkyliftConfig:
    """The validated default configuration (same as ``load_config()``)."""
    return load_config()


def parse_override(override: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and parse the value like OmegaConf's dotlist (YAML scalars and lists)."""
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(
            f"malformed override {override!r}: expected key=value, e.g. trainer.train_batch_size=16"
        )
    key, raw = override.split("=", 1)
    key = key.strip()
    key = key.lstrip("+")  # Hydra's "add a key" prefixes: keys here either exist or are not allowed
    if not key or any(not part for part in key.split(".")) or key.startswith(("~", "-")):
        raise ConfigError(f"malformed override {override!r}: {key!r} is not a dotted key like trainer.seed=1")
    try:
        parsed = OmegaConf.from_dotlist([f"value={raw}"])
    except OmegaConfBaseException as exc:
        raise ConfigError(f"malformed override {override!r}: {_first_line(exc)}", key=key) from exc
    return key, OmegaConf.to_container(parsed, resolve=False)["value"]


def _file_assignments(path: Path) -> Iterator[tuple[str, Any]]:
    """The leaf assignments of a YAML config file as (dotted key, value) pairs."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {_first_line(exc)}") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file {path} must hold a mapping of groups (data, trainer, ...), not a list"
        )
    container = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(container, dict)
    yield from _flatten(container, "", str(path))


def _flatten(node: dict[Any, Any], prefix: str, source: str) -> Iterator[tuple[str, Any]]:
    """Walk nested groups down to (dotted leaf key, value) pairs; aliases are mapped on the way."""
    table = key_table()
    for name, value in node.items():
        if not prefix and name in _HYDRA_KEYS:
            continue
        key = _canonical(f"{prefix}{name}")
        info = table.get(key)
        is_group = (info is not None and info.is_group) or any(a.startswith(key + ".") for a in KEY_ALIASES)
        if is_group:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{key} is a group of keys and needs a mapping, got {value!r} (from {source})", key=key
                )
            yield from _flatten(value, key + ".", source)
        else:
            yield key, value


def _canonical(key: str) -> str:
    """The skylift name of a key: an alias, or a key inside an aliased mapping (``...engine_init_kwargs.x``)."""
    if key in KEY_ALIASES:
        return KEY_ALIASES[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        target = KEY_ALIASES.get(".".join(parts[:i]))
        if target is not None:
            return ".".join([target, *parts[i:]])
    return key


def _check_key(key: str, source: str) -> None:
    if key in key_table() or mapping_leaf_of(key) is not None:
        return
    example = skyrl_example_generator(key)
    if example is not None:
        raise ConfigError(
            f"{key} (from {source}) is read only by {example}; skylift does not run that example's own "
            "generator (skylift's multi-turn agents with tools: docs/agentic.md)",
            key=key,
        )
    suggestions = suggest_keys(key)
    if suggestions:
        hint = f"; did you mean {suggestions[0]}?"
        if len(suggestions) > 1:
            hint += f" (also close: {', '.join(suggestions[1:])})"
    else:
        groups = [k for k, info in key_table().items() if info.is_group and "." not in k]
        hint = f"; keys start with one of {', '.join(groups)} (see `skylift train --help`)"
    raise ConfigError(f"unknown config key {key} (from {source}){hint}", key=key, suggestions=suggestions)


def _assign(cfg: DictConfig, key: str, value: Any, source: str, skyrl: SkyRLKeys) -> None:
    """Set one dotted key, checking the key and the value's type (SkyRL-only keys go to `skyrl`)."""
    key = _canonical(key)
    known = key in key_table() or mapping_leaf_of(key) is not None
    if not known and isinstance(value, dict) and value:  # a group of SkyRL keys, e.g. from a file
        for name, sub_value in value.items():
            _assign(cfg, f"{key}.{name}", sub_value, source, skyrl)
        return
    value = skyrl.value(key, value)
    if skyrl.take(key, value, source):
        return
    _check_key(key, source)
    info = key_table().get(key)
    if info is not None and info.is_group:
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key} is a group of keys; set its members, e.g. {key}.<name>=... (from {source})", key=key
            )
        for sub_key, sub_value in _flatten(value, key + ".", source):
            _assign(cfg, sub_key, sub_value, source, skyrl)
        return
    if (
        info is not None
        and isinstance(value, str)
        and is_list_type(info.annotation)
        and not _is_interp(value)
    ):
        value = [value]  # a single path or url where a list is expected
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        expected = type_name(info.annotation) if info is not None else "a different value"
        raise ConfigError(
            f"invalid value for {key}: expected {expected}, got {_show(value)} (from {source}; {_first_line(exc)})",
            key=key,
        ) from exc


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _is_interp(value: str) -> bool:
    return "${" in value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
