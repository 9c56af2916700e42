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

from skylift.config.device_defaults import apply_device_defaults
from skylift.config.dialects import KeyDialect, key_aliases, start_dialects
from skylift.config.errors import ConfigError
from skylift.config.formatting import set_derived_keys
from skylift.config.inert import warn_without_effect
from skylift.config.keys import is_list_type, key_table, mapping_leaf_of, suggest_keys, type_name
from skylift.config.schema import SkyliftConfig
from skylift.config.validation import finalize, validate_config
from skylift.utils.devices import cuda_available

_HYDRA_KEYS = ("defaults", "hydra")  # a Hydra config file's own entries, not settings


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> SkyliftConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``key.sub=value``), validated,
    with the device defaults of this process's devices (see `load_config_for`)."""
    return load_config_for(overrides, config_file, cuda_available())[0]


def load_config_for(
    overrides: Sequence[str], config_file: str | Path | None, cuda: bool
) -> tuple[SkyliftConfig, list[str]]:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``key.sub=value``), validated,
    for a run that sees CUDA (`cuda`) or not: the config and the GPU-default keys it took
    (`device_defaults.apply_device_defaults`; `skylift train --dry-run --gpus` plans a GPU run).

    Returns real dataclass instances with derived defaults filled in (see
    ``skylift.config.validation.finalize``); a key of ``skylift.config.inert.WITHOUT_EFFECT`` set to
    a non-default value logs a warning naming it. Other projects' keys go through the dialects
    (`skylift.config.dialects`; SkyRL's: ``skylift.compat.skyrl.keys``), which may set them aside
    with a warning or refuse them. Raises ``ConfigError`` on an unknown key (with the closest valid
    key), a value of the wrong type, a malformed override, an invalid combination, or a backend
    skylift does not have (Megatron, DeepSpeed).
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    cfg = OmegaConf.structured(SkyliftConfig)
    dialects = start_dialects()
    file_items = list(_file_assignments(Path(config_file))) if config_file is not None else []
    parsed = [(override, *parse_override(override)) for override in overrides]
    for dialect in dialects:
        dialect.refuse([*file_items, *((key, value) for _, key, value in parsed)])
    given: set[str] = set()
    for key, value in file_items:
        _assign(cfg, key, value, str(config_file), dialects, given)
    for override, key, value in parsed:
        _assign(cfg, key, value, f"override {override!r}", dialects, given)
    for dialect in dialects:
        for key, value in dialect.translations():
            _assign(cfg, key, value, dialect.TRANSLATION_SOURCE, dialects, given)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(
            f"cannot resolve {key or 'the configuration'}: {_first_line(exc)}", key=key
        ) from exc
    assert isinstance(obj, SkyliftConfig)
    applied = apply_device_defaults(obj, given, cuda)  # bf16 and CUDA graphs on GPUs
    derived = finalize(obj)
    validate_config(obj)
    set_derived_keys(obj, derived)
    warn_without_effect(obj)
    for dialect in dialects:
        dialect.warn()
    return obj, applied


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
    empty = raw.strip() == ""  # key= is the empty string, as Hydra reads it
    key = key.lstrip("+")  # Hydra's "add a key" prefixes: keys here either exist or are not allowed
    if not key or any(not part for part in key.split(".")) or key.startswith(("~", "-")):
        raise ConfigError(f"malformed override {override!r}: {key!r} is not a dotted key like trainer.seed=1")
    if empty:
        return key, ""
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
    table, aliases = key_table(), key_aliases()
    for name, value in node.items():
        if not prefix and name in _HYDRA_KEYS:
            continue
        key = _canonical(f"{prefix}{name}")
        info = table.get(key)
        is_group = (info is not None and info.is_group) or any(a.startswith(key + ".") for a in aliases)
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
    aliases = key_aliases()
    if key in aliases:
        return aliases[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        target = aliases.get(".".join(parts[:i]))
        if target is not None:
            return ".".join([target, *parts[i:]])
    return key


def _check_key(key: str, source: str, dialects: Sequence[KeyDialect]) -> None:
    if key in key_table() or mapping_leaf_of(key) is not None:
        return
    for dialect in dialects:
        message = dialect.unknown_key(key, source)
        if message is not None:
            raise ConfigError(message, key=key)
    suggestions = suggest_keys(key)
    if suggestions:
        hint = f"; did you mean {suggestions[0]}?"
        if len(suggestions) > 1:
            hint += f" (also close: {', '.join(suggestions[1:])})"
    else:
        groups = [k for k, info in key_table().items() if info.is_group and "." not in k]
        hint = f"; keys start with one of {', '.join(groups)} (see `skylift train --help`)"
    raise ConfigError(f"unknown config key {key} (from {source}){hint}", key=key, suggestions=suggestions)


def _assign(
    cfg: DictConfig,
    key: str,
    value: Any,
    source: str,
    dialects: Sequence[KeyDialect],
    given: set[str] | None = None,
) -> None:
    """Set one dotted key, checking the key and the value's type (a dialect's own keys go to it);
    `given` collects the keys set."""
    key = _canonical(key)
    known = key in key_table() or mapping_leaf_of(key) is not None
    if not known and isinstance(value, dict) and value:  # a group of keys, e.g. from a file
        for name, sub_value in value.items():
            _assign(cfg, f"{key}.{name}", sub_value, source, dialects, given)
        return
    for dialect in dialects:
        value = dialect.value(key, value)
    if any(dialect.take(key, value, source) for dialect in dialects):
        return
    _check_key(key, source, dialects)
    info = key_table().get(key)
    if info is not None and info.is_group:
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key} is a group of keys; set its members, e.g. {key}.<name>=... (from {source})", key=key
            )
        for sub_key, sub_value in _flatten(value, key + ".", source):
            _assign(cfg, sub_key, sub_value, source, dialects, given)
        return
    if (
        info is not None
        and isinstance(value, str)
        and is_list_type(info.annotation)
        and not _is_interp(value)
    ):
        value = [value]  # a single path or url where a list is expected
    if given is not None:
        given.add(key)
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
