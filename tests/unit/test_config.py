"""Tests of the typed configuration: dotlist parsing, key/type errors, validation, YAML round trips."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml

from skylift.config import (
    ConfigError,
    SkyliftConfig,
    config_keys,
    field_help,
    format_config,
    load_config,
    parse_override,
    to_dict,
)

# The seed's training command (run_remote.sh) as the shell hands it over, with $HOME = /home/u.
SEED_COMMAND = """
    generator.run_engines_locally=False
    generator.remote_inference_engine_urls="['127.0.0.1:8001']"
    generator.override_existing_update_group=True
    generator.sampling_params.temperature=0.6
    generator.sampling_params.top_p=0.95
    data.train_data="['/home/u/data/gsm8k/train.parquet']"
    data.val_data="['/home/u/data/gsm8k/validation.parquet']"
    trainer.policy.model.path="Qwen/Qwen2.5-1.5B-Instruct"
    trainer.algorithm.advantage_estimator="grpo"
    trainer.placement.colocate_all=False
    trainer.placement.policy_num_gpus_per_node=4
    trainer.placement.ref_num_gpus_per_node=4
    trainer.train_batch_size=64
    trainer.policy_mini_batch_size=64
    trainer.micro_forward_batch_size_per_gpu=20
    trainer.micro_train_batch_size_per_gpu=20
    trainer.eval_batch_size=1024
    trainer.eval_before_train=true
    trainer.eval_interval=5
"""
SEED_ARGS = shlex.split(SEED_COMMAND)


def test_seed_args_are_what_a_shell_passes() -> None:
    assert "generator.remote_inference_engine_urls=['127.0.0.1:8001']" in SEED_ARGS
    assert "data.train_data=['/home/u/data/gsm8k/train.parquet']" in SEED_ARGS
    assert "trainer.policy.model.path=Qwen/Qwen2.5-1.5B-Instruct" in SEED_ARGS


def test_seed_command_parses_into_typed_values() -> None:
    cfg = load_config(SEED_ARGS)
    assert isinstance(cfg, SkyliftConfig)
    g, t = cfg.generator, cfg.trainer
    assert g.run_engines_locally is False
    assert g.remote_inference_engine_urls == ["127.0.0.1:8001"]
    assert g.override_existing_update_group == "enable"
    assert g.sampling_params.temperature == pytest.approx(0.6)
    assert g.sampling_params.top_p == pytest.approx(0.95)
    assert cfg.data.train_data == ["/home/u/data/gsm8k/train.parquet"]
    assert cfg.data.val_data == ["/home/u/data/gsm8k/validation.parquet"]
    assert t.policy.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert t.ref.model.path == "Qwen/Qwen2.5-1.5B-Instruct"  # null = same as the policy
    assert t.algorithm.advantage_estimator == "grpo"
    assert t.placement.colocate_all is False
    assert (t.placement.policy_num_gpus_per_node, t.placement.ref_num_gpus_per_node) == (4, 4)
    assert (t.train_batch_size, t.policy_mini_batch_size) == (64, 64)
    assert (t.micro_forward_batch_size_per_gpu, t.micro_train_batch_size_per_gpu) == (20, 20)
    assert (t.eval_batch_size, t.eval_before_train, t.eval_interval) == (1024, True, 5)
    for value, kind in [
        (g.sampling_params.temperature, float),
        (t.train_batch_size, int),
        (g.run_engines_locally, bool),
    ]:
        assert type(value) is kind


def test_every_seed_key_is_a_config_key() -> None:
    keys = set(config_keys())
    for arg in SEED_ARGS:
        assert arg.split("=", 1)[0] in keys


def test_documented_keys_exist_and_have_help() -> None:
    keys = config_keys()
    expected = {
        "trainer.epochs",
        "trainer.max_steps",
        "trainer.ckpt_path",
        "trainer.ckpt_interval",
        "trainer.resume_mode",
        "trainer.logger",
        "trainer.export_path",
        "trainer.policy.optimizer_config.lr",
        "trainer.policy.model.lora.rank",
        "trainer.algorithm.kl_estimator_type",
        "trainer.algorithm.use_tis",
        "trainer.async_training",
        "trainer.max_staleness_steps",
        "generator.n_samples_per_prompt",
        "generator.max_generate_length",
        "generator.sampling_params.max_generate_length",
        "generator.num_inference_engines",
        "generator.eval_sampling_params.temperature",
        "generator.http_timeout_s",
        "environment.env_class",
        "data.prompt_key",
    }
    assert expected <= set(keys)
    assert len(keys) == len(set(keys))
    assert all(field_help(k).strip() for k in keys), [k for k in keys if not field_help(k).strip()]


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("trainer.polcy_mini_batch_size=4", "trainer.policy_mini_batch_size"),
        ("generator.sampling_params.temprature=0.5", "generator.sampling_params.temperature"),
        ("trainer.lr=1e-5", "trainer.policy.optimizer_config.lr"),
        ("generator.remote_inference_engine_url=['h:1']", "generator.remote_inference_engine_urls"),
    ],
)
def test_misspelt_key_names_key_and_suggests_closest(override: str, suggestion: str) -> None:
    bad_key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as info:
        load_config([override])
    message = str(info.value)
    assert bad_key in message
    assert f"did you mean {suggestion}?" in message
    assert info.value.key == bad_key
    assert info.value.suggestions[0] == suggestion


def test_unknown_top_level_key_lists_groups() -> None:
    with pytest.raises(ConfigError, match="data, trainer, generator, environment"):
        load_config(["zzz.yyy=1"])


@pytest.mark.parametrize(
    ("override", "key", "expected_type", "shown"),
    [
        ("trainer.train_batch_size=abc", "trainer.train_batch_size", "int", "'abc'"),
        (
            "generator.sampling_params.temperature=hot",
            "generator.sampling_params.temperature",
            "float",
            "'hot'",
        ),
        ("trainer.eval_before_train=maybe", "trainer.eval_before_train", "bool", "'maybe'"),
        ("trainer.seed=null", "trainer.seed", "int", "null"),
        ("trainer.train_batch_size=2.5", "trainer.train_batch_size", "int", "2.5"),
    ],
)
def test_wrong_type_names_key_type_and_value(override: str, key: str, expected_type: str, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([override])
    message = str(info.value)
    assert f"invalid value for {key}: expected {expected_type}, got {shown}" in message
    assert info.value.key == key


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("override", ["trainer.seed", "=5", "trainer..seed=1"])
def test_malformed_override(override: str) -> None:
    with pytest.raises(ConfigError, match="malformed override"):
        load_config([override])


def test_parse_override_values() -> None:
    assert parse_override("a.b=['127.0.0.1:8001']") == ("a.b", ["127.0.0.1:8001"])
    assert parse_override("a=True") == ("a", True)
    assert parse_override("a=false") == ("a", False)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=1e-5") == ("a", 1e-5)
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("+a=3") == ("a", 3)


def test_list_overrides() -> None:
    cfg = load_config(
        [
            "data.val_data=['/d/a.parquet', '/d/b.parquet']",
            "data.train_data=/d/single.parquet",
            "trainer.policy.optimizer_config.adam_betas=[0.8,0.95]",
            "trainer.logger=[console,tensorboard]",
            "generator.sampling_params.stop=['</answer>']",
            "generator.remote_inference_engine_urls=['127.0.0.1:8001','http://127.0.0.1:8002']",
        ]
    )
    assert cfg.data.val_data == ["/d/a.parquet", "/d/b.parquet"]
    assert cfg.data.train_data == ["/d/single.parquet"]
    assert cfg.trainer.policy.optimizer_config.adam_betas == [0.8, 0.95]
    assert cfg.trainer.loggers() == ["console", "tensorboard"]
    assert cfg.generator.sampling_params.stop == ["</answer>"]
    assert cfg.generator.remote_inference_engine_urls == ["127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert load_config(["trainer.logger=wandb"]).trainer.loggers() == ["wandb"]


def test_wrong_list_item_type() -> None:
    with pytest.raises(
        ConfigError, match="trainer.policy.optimizer_config.adam_betas: expected list of float"
    ):
        load_config(["trainer.policy.optimizer_config.adam_betas=[a,b]"])


def test_yaml_file_then_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "trainer:\n"
        "  train_batch_size: 32\n"
        "  policy_mini_batch_size: 16\n"
        "  critic_mini_batch_size: 16\n"
        "  policy:\n"
        "    model:\n"
        "      path: tiny-qwen2\n"
        "generator:\n"
        "  n_samples_per_prompt: 2\n"
        "  sampling_params:\n"
        "    temperature: 0.7\n"
        "environment:\n"
        "  env_kwargs:\n"
        "    strict: false\n"
    )
    cfg = load_config(
        ["trainer.train_batch_size=64", "generator.sampling_params.temperature=0.9"], config_file=path
    )
    assert cfg.trainer.train_batch_size == 64  # override wins
    assert cfg.trainer.policy_mini_batch_size == 16  # from the file
    assert cfg.trainer.policy.model.path == "tiny-qwen2"
    assert cfg.trainer.ref.model.path == "tiny-qwen2"
    assert cfg.generator.n_samples_per_prompt == 2
    assert cfg.generator.sampling_params.temperature == pytest.approx(0.9)
    assert cfg.environment.env_kwargs == {"strict": False}


def test_yaml_file_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  placement:\n    colocate_al: true\n")
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path)
    assert "trainer.placement.colocate_al" in str(info.value)
    assert str(path) in str(info.value)
    assert info.value.suggestions[0] == "trainer.placement.colocate_all"

    path.write_text("trainer:\n  eval_interval: often\n")
    with pytest.raises(ConfigError, match="invalid value for trainer.eval_interval: expected int"):
        load_config(config_file=path)

    path.write_text("trainer: 3\n")
    with pytest.raises(ConfigError, match="trainer is a group of keys"):
        load_config(config_file=path)

    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["trainer.train_batch_size=10"],
            "trainer.train_batch_size=10 must be divisible by trainer.policy_mini_batch_size=8",
        ),
        (["generator.n_samples_per_prompt=0"], "generator.n_samples_per_prompt=0 must be >= 1"),
        (
            ["trainer.algorithm.advantage_estimator=ppo"],
            "advantage_estimator='ppo' is not one of grpo, rloo, maxrl, reinforce++, gae",
        ),
        (
            ["trainer.algorithm.policy_loss_type=clip"],
            "policy_loss_type='clip' is not one of regular, dual_clip, gspo, cispo",
        ),
        (
            ["trainer.algorithm.loss_reduction=sum"],
            "loss_reduction='sum' is not one of token_mean, sequence_mean",
        ),
        (["trainer.algorithm.kl_estimator_type=k4"], "kl_estimator_type='k4' is not one of k1, k2, k3"),
        (
            ["generator.run_engines_locally=false", "generator.remote_inference_engine_urls=[]"],
            "generator.run_engines_locally=false needs generator.remote_inference_engine_urls",
        ),
        (
            ["generator.run_engines_locally=false", "generator.remote_inference_engine_urls=['localhost']"],
            "'localhost' is not host:port",
        ),
        (
            ["trainer.algorithm.use_kl_loss=true", "trainer.algorithm.use_kl_in_reward=true"],
            "mutually exclusive",
        ),
        (["trainer.resume_mode=from_path"], "trainer.resume_mode=from_path needs trainer.resume_path"),
        (["trainer.logger=[console,neptune]"], "trainer.logger='neptune' is not one of"),
        (["trainer.algorithm.use_tis=true"], "tis_imp_ratio_cap > 0"),
        (
            ["trainer.algorithm.policy_loss_type=dual_clip", "trainer.algorithm.clip_ratio_c=1.0"],
            "clip_ratio_c=1.0 must be > 1",
        ),
        (["generator.sampling_params.top_p=0"], "generator.sampling_params.top_p=0.0 must be in (0, 1]"),
        (["trainer.eval_interval=-2"], "trainer.eval_interval=-2 must be >= -1"),
        (["trainer.async_training=true", "trainer.placement.colocate_all=true"], "cannot run with"),
        (
            ["trainer.async_training=true", "trainer.max_staleness_steps=0"],
            "max_staleness_steps=0 must be >= 1",
        ),
        (["generator.max_turns=3"], "generator.batched=true supports only max_turns=1"),
        (
            ["trainer.placement.policy_num_gpus_per_node=3"],
            "training batch of 32 sequences (trainer.train_batch_size * generator.n_samples_per_prompt) "
            "must split evenly over the 3 policy workers",
        ),
        (
            ["trainer.placement.policy_num_gpus_per_node=64"],
            "policy mini-batch of 32 sequences (trainer.policy_mini_batch_size * generator.n_samples_per_prompt) "
            "must hold at least one sequence for each of the 64 policy workers",
        ),
        (["trainer.algorithm.advantage_estimator=rloo", "generator.n_samples_per_prompt=1"], "rloo needs"),
        (
            ["generator.override_existing_update_group=sometimes"],
            "override_existing_update_group='sometimes'",
        ),
    ],
)
def test_semantic_validation(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert fragment in str(info.value)
    assert any(fragment in p for p in info.value.problems)


def test_all_semantic_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.algorithm.advantage_estimator=ppo", "trainer.algorithm.kl_estimator_type=k9"])
    assert len(info.value.problems) == 2
    assert "2 problem(s)" in str(info.value)


def test_defaults_round_trip_through_format_config(tmp_path: Path) -> None:
    cfg = load_config()
    text = format_config(cfg)
    path = tmp_path / "defaults.yaml"
    path.write_text(text)
    assert load_config(config_file=path) == cfg
    # plain YAML readers see the same tree (derived keys stay null so that reloading derives them again)
    plain = yaml.safe_load(text)
    expected = to_dict(cfg)
    expected["trainer"]["ref"]["model"]["path"] = None
    for key in ("ckpt_path", "export_path", "log_dir"):
        expected["trainer"][key] = None
    expected["generator"]["max_input_length"] = None
    expected["generator"]["eval_sampling_params"]["max_generate_length"] = None
    assert plain == expected


def test_seed_config_round_trips_with_help(tmp_path: Path) -> None:
    cfg = load_config(SEED_ARGS)
    text = format_config(cfg, with_help=True)
    path = tmp_path / "seed.yaml"
    path.write_text(text)
    assert load_config(config_file=path) == cfg
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == len(config_keys()) + sum(
        1 for ln in lines if ln.rstrip().split("#")[0].rstrip().endswith(":")
    )
    assert all("  # " in ln for ln in lines)
    assert "train_batch_size: 64  # " + field_help("trainer.train_batch_size") in text


def test_derived_values_follow_their_source_after_reload(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(format_config(load_config(["trainer.run_name=first"])))
    cfg = load_config(["trainer.policy.model.path=tiny-qwen2", "trainer.run_name=second"], config_file=path)
    assert cfg.trainer.ref.model.path == "tiny-qwen2"
    assert Path(cfg.trainer.ckpt_path).parts[-2:] == ("second", "ckpts")
    assert Path(cfg.trainer.export_path).parts[-2:] == ("second", "exports")


def test_derived_defaults() -> None:
    cfg = load_config(
        [
            "generator.max_generate_length=64",
            "trainer.max_prompt_length=300",
            "trainer.ckpt_path=~/my_ckpts",
            "trainer.algorithm.advantage_estimator=gae",
        ]
    )
    g = cfg.generator
    assert g.sampling_params.max_generate_length == 64  # the shorthand wins
    assert g.eval_sampling_params.max_generate_length == 64
    assert g.eval_sampling_params.temperature == 0.0
    assert g.max_input_length == 300
    assert cfg.trainer.ckpt_path == str(Path.home() / "my_ckpts")
    assert cfg.trainer.critic.model.path == cfg.trainer.policy.model.path
    assert load_config().trainer.critic.model.path is None
    assert load_config(["trainer.resume_mode=null"]).trainer.resume_mode == "none"
    assert load_config(
        ["generator.override_existing_update_group=false"]
    ).generator.override_existing_update_group == ("disable")


def test_interpolation_and_explicit_eval_length() -> None:
    cfg = load_config(
        [
            "trainer.run_name=exp1",
            "trainer.project_name=${trainer.run_name}",
            "generator.sampling_params.max_generate_length=128",
            "generator.eval_sampling_params.max_generate_length=32",
        ]
    )
    assert cfg.trainer.project_name == "exp1"
    assert cfg.generator.sampling_params.max_generate_length == 128
    assert cfg.generator.eval_sampling_params.max_generate_length == 32
    with pytest.raises(ConfigError, match="cannot resolve trainer.project_name"):
        load_config(["trainer.project_name=${trainer.nope}"])


def test_newer_skyrl_engine_keys_are_aliases(tmp_path: Path) -> None:
    cfg = load_config(
        [
            "generator.inference_engine.run_engines_locally=False",
            "generator.inference_engine.remote_urls=['127.0.0.1:9000']",
            "generator.inference_engine.tensor_parallel_size=2",
        ]
    )
    assert cfg.generator.run_engines_locally is False
    assert cfg.generator.remote_inference_engine_urls == ["127.0.0.1:9000"]
    assert cfg.generator.inference_engine_tensor_parallel_size == 2
    path = tmp_path / "new.yaml"
    path.write_text("generator:\n  inference_engine:\n    num_engines: 3\n")
    assert load_config(config_file=path).generator.num_inference_engines == 3


def test_defaults_are_cpu_friendly_and_valid() -> None:
    cfg = load_config()
    assert cfg.trainer.policy.model.path == "smollm2-135m-instruct"
    assert cfg.trainer.placement.colocate_all is False
    assert cfg.generator.model_dtype == "float32"
    assert cfg.environment.env_class == "gsm8k"
    assert cfg.trainer.train_batch_size % cfg.trainer.policy_mini_batch_size == 0
    # each load builds fresh objects: mutating one config does not leak into the next
    cfg.data.train_data.append("/x.parquet")
    assert load_config().data.train_data != cfg.data.train_data


def test_to_dict_and_dataclasses() -> None:
    cfg = load_config(["trainer.seed=7"])
    d = to_dict(cfg)
    assert d["trainer"]["seed"] == 7
    assert set(d) == {"data", "trainer", "generator", "environment"}
    assert dataclasses.is_dataclass(cfg.trainer.algorithm)
    with pytest.raises(TypeError):
        to_dict({"a": 1})


def test_overrides_must_be_a_sequence_of_strings() -> None:
    with pytest.raises(TypeError, match="sequence"):
        load_config("trainer.seed=1")  # type: ignore[arg-type]


def test_run_remote_script_extra_keys() -> None:
    extra = shlex.split(
        'trainer.strategy=fsdp2 trainer.logger="wandb" trainer.project_name="remote_inference_engine" '
        'trainer.run_name="remote_inference_engine_test" trainer.resume_mode=null trainer.ckpt_path="/home/u/ckpts/"'
    )
    cfg = load_config(SEED_ARGS + extra)
    t = cfg.trainer
    assert (t.strategy, t.loggers(), t.resume_mode) == ("fsdp2", ["wandb"], "none")
    assert (t.project_name, t.run_name, t.ckpt_path) == (
        "remote_inference_engine",
        "remote_inference_engine_test",
        "/home/u/ckpts/",
    )
