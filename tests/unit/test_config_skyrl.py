"""SkyRL's configuration on skylift: every key of both schemas, and SkyRL's own example commands.

- Both schemas (skyrl-train 0.3.1's YAML, skyrl 0.4.0's dataclasses) come from the wheels
  scripts/setup.sh downloads (`tests/skyrl_schema.py`); those tests skip when the wheels are absent.
- The example commands are the override lists of every shell script under SkyRL's ``examples/``
  (at the head of its repository and at the ``skyrl_train-v0.4.0`` tag), stored in
  ``tests/unit/data/skyrl_commands_*.txt`` by ``scripts/skyrl_example_overrides.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from skyrl_schema import skyrl_keys, skyrl_train_keys

from skylift.compat.skyrl.keys import _COLLECTED, backend_refusal
from skylift.compat.skyrl.unused_keys import SKYRL_NOT_IMPLEMENTED, SKYRL_WITHOUT_EFFECT, skyrl_declaration
from skylift.config import ConfigError, load_config
from skylift.config.keys import key_table, mapping_leaf_of
from skylift.config.loading import _canonical
from skylift.envs import UnknownEnvironmentError, get_env_factory

DATA = Path(__file__).parent / "data"
MEGATRON = "skylift has no Megatron backend"


def _handled(key: str) -> bool:
    """Implemented (a schema key, an alias or inside a mapping key), declared, or refused as Megatron."""
    key = _canonical(key)
    return (
        key in key_table()
        or mapping_leaf_of(key) is not None
        or key in _COLLECTED
        or skyrl_declaration(key) is not None
        or backend_refusal(key) is not None
    )


@pytest.mark.parametrize("schema", [skyrl_train_keys, skyrl_keys], ids=["skyrl-train-0.3.1", "skyrl-0.4.0"])
def test_every_key_of_skyrls_schema_is_implemented_declared_or_refused(schema) -> None:  # noqa: ANN001
    keys = schema()
    assert len(keys) > 200  # the whole schema was read, not an empty file
    missing = sorted(k for k in keys if not _handled(k))
    assert not missing, (
        f"SkyRL keys skylift neither implements nor declares: {missing}; implement them or declare "
        "them in skylift.compat.skyrl.unused_keys.SKYRL_WITHOUT_EFFECT with the reason"
    )


def test_declared_skyrl_keys_are_not_schema_keys() -> None:
    for pattern in [*SKYRL_WITHOUT_EFFECT, *SKYRL_NOT_IMPLEMENTED]:
        key = pattern.rstrip("*").rstrip(".")
        assert key not in key_table() and mapping_leaf_of(key) is None, pattern


# ------------------------------------------------------------------------------ example commands


def _commands(name: str) -> list[tuple[str, str, list[str]]]:
    """(source path:index, entry point, overrides) of each command of a fixture."""
    out: list[tuple[str, str, list[str]]] = []
    for line in (DATA / name).read_text().splitlines():
        if line.startswith("# "):
            source, entry = line[2:].split(" ", 1)
            out.append((source, entry, []))
        elif line:
            out[-1][2].append(line)
    return out


def _is_megatron(overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    return any("megatron_config" in k for k in keys) or "trainer.strategy=megatron" in overrides


def _is_training(entry: str) -> bool:
    return not entry.endswith(
        ("serve", "main_generate", "main_tbench_generate", "main_sft")
    )  # sft: its own test


# Non-Megatron training commands skylift refuses, each with the words of its refusal. Built into
# SkyRL's main_base: delta weight sync to an empty sync_dir, a key SkyRL's own schema lacks, an unset shell variable. Example
# entry points with their own Python code (custom losses, estimators, generators: not main_base)
# register names and keys skylift cannot know.
EXPECTED_REFUSALS = {
    # SYNC_DIR is a gs:// or s3:// URI the script requires; unset here, so empty (with it set, the
    # commands are accepted: checked below)
    "examples/train/delta_weight_sync/disagg/run_gsm8k_qwen1p5b_s3.sh:1": "delta_weight_sync.sync_dir is required",
    "examples/train/delta_weight_sync/run_gsm8k_qwen1p5b_gcs.sh:1": "delta_weight_sync.sync_dir is required",
    "examples/train/rlm/run_multi_paper_rlm.sh:1": "generator.enable_child_agents (from override 'generator.enable_child_agents=true') is read only by SkyRL's RLM example",
    "examples/train/text_to_sql/run_sql_fsdp_2node.sh:1": "unknown config key trainer.placement.reward_num_nodes",
    # terminal-bench's generator runs each task in a Docker sandbox through Harbor; mini-SWE-agent's
    # commands are accepted (the gateway runs it: tests/unit/test_skyrl_miniswe.py)
    "skyrl-train/examples/terminal_bench/run_codecontest.sh:1": "it needs Docker sandboxes run by Harbor",
    "skyrl-train/examples/terminal_bench/run_otagent.sh:1": "it needs Docker sandboxes run by Harbor",
    "skyrl-train/examples/text_to_sql/run_sql_fsdp_2node.sh:1": "unknown config key trainer.placement.reward_num_nodes",
}


# Example entry points with Python of their own that skylift covers with one key added to the
# command: SkyRL's custom_advantage_estimator and custom_policy_loss register functions (SkyRL's
# signatures and registry calls; here in tests/skyrl_custom_algorithms.py, named by
# trainer.algorithm.import_modules; without the key the refusal names it: test_skyrl_registries.py),
# and on_policy_distillation's trainer subclass is trainer.algorithm.on_policy_distillation.
CUSTOM_MODULE = "tests.skyrl_custom_algorithms"
ENTRY_POINT_KEYS = {
    "custom_advantage_estimator.main_custom_adv_est": f"trainer.algorithm.import_modules=[{CUSTOM_MODULE}]",
    "custom_policy_loss.main_custom_policy_loss": f"trainer.algorithm.import_modules=[{CUSTOM_MODULE}]",
    "on_policy_distillation.main_on_policy_distill": "trainer.algorithm.on_policy_distillation=true",
}


# Accepted commands whose environment only their own example entry point registers (its Python is
# SkyRL's example code, not a key skylift could give effect): the configuration runs, the
# environment name does not resolve until the user registers one (environment.import_modules).
UNREGISTERED_ENVS = {"llm_as_a_judge", "multiply"}
# SkyRL's visgym entry point picks its environment variant with --env_variant, which is not an
# override: here it is one key (without it, the instruct variant).
VARIANT_KEYS = {"run_visgym_from_sft.sh:1": "environment.env_configs.visgym.variant=sft"}


DEFAULT_ENV = "gsm8k"  # environment.env_class's default (checked below)


def _env_class(overrides: list[str]) -> str:
    value = next((o.split("=", 1)[1] for o in overrides if o.startswith("environment.env_class=")), None)
    return value if value is not None else DEFAULT_ENV


def _env_resolves(overrides: list[str]) -> bool:
    try:
        get_env_factory(_env_class(overrides))
    except UnknownEnvironmentError:
        return False
    return True


def _load(overrides: list[str]) -> str | None:
    """None when the command loads and validates, else the error message."""
    try:
        load_config(overrides)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("fixture", ["skyrl_commands_head.txt", "skyrl_commands_0.4.0.txt"])
def test_skyrls_example_commands_are_accepted_or_refused_clearly(fixture: str) -> None:
    logging.getLogger("skylift.config").setLevel(logging.ERROR)  # the warnings are tested elsewhere
    commands = [c for c in _commands(fixture) if _is_training(c[1])]
    assert len(commands) >= 60
    wrong: list[str] = []
    accepted = megatron = runnable = 0
    ported = 0
    vlm: dict[str, bool] = {}
    for source, entry, overrides in commands:
        key = next((k for suffix, k in ENTRY_POINT_KEYS.items() if entry.endswith(suffix)), None)
        key = key or next((k for suffix, k in VARIANT_KEYS.items() if source.endswith(suffix)), None)
        if key is not None:
            overrides = [*overrides, key]
            ported += 1
        error = _load(overrides)
        if _is_megatron(overrides):
            megatron += 1
            if error is None or not error.startswith(MEGATRON):
                wrong.append(f"{source}: a Megatron command got {error!r}")
            continue
        expected = EXPECTED_REFUSALS.get(source)
        if expected is None and error is not None:
            wrong.append(f"{source}: refused: {error}")
        elif expected is not None and (error is None or expected not in error):
            wrong.append(f"{source}: expected a refusal with {expected!r}, got {error!r}")
        elif expected is not None and "sync_dir is required" in expected:  # with SYNC_DIR set
            with_uri = [
                o + "s3://bucket/run" if o.endswith("delta_weight_sync.sync_dir=") else o for o in overrides
            ]
            if (late := _load(with_uri)) is not None:
                wrong.append(f"{source}: with SYNC_DIR=s3://bucket/run, refused: {late}")
        accepted += error is None
        if error is None:  # accepted: its environment must resolve too, or be a known exception
            resolves = _env_resolves(overrides)
            runnable += resolves
            if resolves == (_env_class(overrides) in UNREGISTERED_ENVS):
                wrong.append(f"{source}: environment {_env_class(overrides)!r} resolves: {resolves}")
            if "generator.vision_language_generator=true" in overrides:
                vlm[source] = resolves
    logging.getLogger("skylift.config").setLevel(logging.NOTSET)
    assert not wrong, "\n".join(wrong)
    assert load_config().environment.env_class == DEFAULT_ENV
    assert ported == (5 if fixture == "skyrl_commands_head.txt" else 4)
    # SkyRL's 4 vision-language scripts (geometry3k, its LoRA variant, visgym from instruct and
    # from SFT) are at head only; all 4 load and name an environment skylift ships
    assert (sum(vlm.values()), len(vlm)) == ((4, 4) if fixture == "skyrl_commands_head.txt" else (0, 0))
    print(
        f"{fixture}: {accepted} of {len(commands) - megatron} non-Megatron training commands accepted, "
        f"{runnable} with their environment registered; vision-language: {sum(vlm.values())} of {len(vlm)}"
    )
