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
from skylift.config.loading import _canonical, parse_override
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


def test_dapo_overlong_keys_both_spellings_and_dr_grpo_max_seq_len() -> None:
    old = load_config(
        ["+trainer.algorithm.overlong_buffer.len=64", "+trainer.algorithm.overlong_buffer.penalty_factor=0.5"]
    )
    new = load_config(
        ["trainer.algorithm.overlong_buffer_len=64", "trainer.algorithm.overlong_buffer_penalty_factor=0.5"]
    )
    for cfg in (old, new):
        assert (
            cfg.trainer.algorithm.overlong_buffer.len,
            cfg.trainer.algorithm.overlong_buffer.penalty_factor,
        ) == (
            64,
            0.5,
        )
    with pytest.raises(ConfigError, match="overlong_buffer.len=512 must be <= the response budget"):
        load_config(
            ["trainer.algorithm.overlong_buffer_len=512", "generator.sampling_params.max_generate_length=256"]
        )
    cfg = load_config(
        ["trainer.algorithm.loss_reduction=seq_mean_token_sum_norm", "trainer.algorithm.max_seq_len=1536"]
    )
    from skylift.rl.update import policy_objective

    assert policy_objective(cfg).max_len == 1536
    assert policy_objective(load_config()).max_len == 256  # default: the response budget


def test_strategy_fsdp_is_fsdp2_and_megatron_or_deepspeed_is_refused_with_one_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        assert load_config(["trainer.strategy=fsdp"]).trainer.strategy == "fsdp2"
    assert not caplog.records
    for override in (
        "trainer.strategy=megatron",
        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
        "+trainer.ref.megatron_config.context_parallel_size=2",
    ):
        with pytest.raises(ConfigError) as info:
            load_config(["trainer.not_a_key=1", override])  # checked before any other key
        assert str(info.value).startswith(MEGATRON) and "FSDP2" in str(info.value), override
    with pytest.raises(ConfigError, match="skylift has no DeepSpeed backend"):
        load_config(["trainer.strategy=deepspeed"])


def test_delta_weight_sync_is_accepted_with_a_local_sync_dir_and_its_keys_take_effect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ie = "generator.inference_engine."
    cfg = load_config(
        [
            f"{ie}weight_sync_backend=delta",
            f"{ie}delta_weight_sync.sync_dir={tmp_path}/sync",
            f"{ie}delta_weight_sync.local_checkpoint_dir={tmp_path}/store",
            f"{ie}delta_weight_sync.max_file_size_in_gb=0.5",
            f"{ie}delta_weight_sync.publish_num_workers=3",
            f"{ie}delta_weight_sync.rebase_interval=4",
        ]
    )
    assert cfg.generator.delta_weight_sync.rebase_interval == 4
    d = cfg.generator.delta_weight_sync
    assert cfg.generator.weight_sync_backend == "delta"
    assert (d.sync_dir, d.local_checkpoint_dir) == (f"{tmp_path}/sync", f"{tmp_path}/store")
    assert (d.max_file_size_in_gb, d.publish_num_workers) == (0.5, 3)
    config = tmp_path / "skyrl.yaml"
    config.write_text(
        f"generator:\n  inference_engine:\n    weight_sync_backend: delta\n"
        f"    delta_weight_sync:\n      sync_dir: {tmp_path}/sync\n      cloud_download_workers: 16\n"
    )
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        cfg = load_config([], config_file=config)
    assert cfg.generator.delta_weight_sync.sync_dir == f"{tmp_path}/sync"
    assert cfg.generator.delta_weight_sync.cloud_download_workers == 16
    # a cloud-only key with a local sync_dir does nothing: said so
    assert any(
        "delta_weight_sync.cloud_download_workers has no effect: sync_dir=" in r.message
        for r in caplog.records
    )


def test_delta_weight_sync_refuses_what_it_cannot_do_with_one_clear_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ie = "generator.inference_engine."
    cases = {
        "": "delta_weight_sync.sync_dir is required with weight_sync_backend=delta",
    }
    for sync_dir, words in cases.items():
        with pytest.raises(ConfigError, match=words):
            load_config([f"{ie}weight_sync_backend=delta", f"{ie}delta_weight_sync.sync_dir={sync_dir}"])
    for uri in ("gs://bucket/run", "s3://bucket/run"):  # object storage (skylift.weight_sync.delta.cloud)
        cfg = load_config(
            [
                f"{ie}weight_sync_backend=delta",
                f"{ie}delta_weight_sync.sync_dir={uri}",
                f"{ie}delta_weight_sync.publish_staging_dir=/scratch/staging",
            ]
        )
        assert cfg.generator.delta_weight_sync.publish_staging_dir == "/scratch/staging"
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        load_config(
            [
                f"{ie}weight_sync_backend=delta",
                f"{ie}delta_weight_sync.sync_dir=/shared/sync",
                f"{ie}delta_weight_sync.publish_staging_dir=/scratch/staging",
            ]
        )
    assert any(
        "publish_staging_dir has no effect: sync_dir=/shared/sync is a directory" in r.message
        for r in caplog.records
    )
    with pytest.raises(ConfigError, match="weight_sync_backend=delta does not support LoRA"):
        load_config(
            [
                f"{ie}weight_sync_backend=delta",
                f"{ie}delta_weight_sync.sync_dir=/shared/sync",
                "trainer.policy.model.lora.rank=8",
            ]
        )
    with pytest.raises(ConfigError) as info:  # Megatron's message comes first
        load_config([f"{ie}weight_sync_backend=delta", "trainer.strategy=megatron"])
    assert str(info.value).startswith(MEGATRON)
    with caplog.at_level(logging.WARNING, logger="skylift.config"):  # delta keys without delta
        load_config([f"{ie}delta_weight_sync.sync_dir=/shared/sync"])
    assert any("delta_weight_sync.sync_dir has no effect" in r.message for r in caplog.records)


def test_skyrl_only_keys_warn_when_set_and_algorithm_changes_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        load_config(
            [
                "trainer.flash_attn=true",
                "trainer.policy.sequence_parallel_size=1",
                "trainer.update_ref_every_epoch=false",
            ]
        )
    assert not caplog.records  # SkyRL's defaults: nothing to warn about
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        load_config(["trainer.policy.record_memory=true", "trainer.update_ref_every_epoch=true"])
    text = caplog.text
    assert "trainer.policy.record_memory=True has no effect in skylift: not implemented" in text
    assert "trainer.update_ref_every_epoch=True has no effect in skylift" in text
    with pytest.raises(ConfigError, match="use_entropy_loss=True is not implemented in skylift yet"):
        load_config(["trainer.algorithm.use_entropy_loss=true"])


def test_off_policy_correction_and_skyrl_losses_reach_the_policy_loss() -> None:
    from skylift.rl.update import policy_objective

    p = "trainer.algorithm.off_policy_correction"
    loss = policy_objective(load_config([f"{p}.tis_ratio_type=token", f"{p}.token_tis_ratio_clip_high=3.0"]))
    c = loss.algorithm.off_policy_correction
    assert (c.tis_ratio_type, c.token_tis_ratio_clip_high) == ("token", 3.0)
    assert (
        policy_objective(
            load_config([f"{p}.tis_ratio_type=token"])
        ).algorithm.off_policy_correction.token_tis_ratio_clip_high
        == 2.0
    )
    cfg = load_config(
        [
            f"{p}.tis_ratio_type=sequence",
            f"{p}.sequence_tis_ratio_clip_high=4.0",
            f"{p}.sequence_mask_metric=geometric",
            f"{p}.geo_mask_high=1.02",
            f"{p}.geo_mask_low=0.98",
            f"{p}.outlier_token_is_threshold_high=100",
            f"{p}.token_mask_is_threshold_low=0.5",
            f"{p}.token_mask_is_threshold_high=2",
        ]
    )
    c = policy_objective(cfg).algorithm.off_policy_correction
    assert (
        c.tis_ratio_type,
        c.sequence_tis_ratio_clip_high,
        c.sequence_mask_metric,
        c.geo_mask_low,
        c.geo_mask_high,
    ) == (
        "sequence",
        4.0,
        "geometric",
        0.98,
        1.02,
    )
    assert (
        c.outlier_token_is_threshold_low,
        c.outlier_token_is_threshold_high,
        c.token_mask_is_threshold_low,
        c.token_mask_is_threshold_high,
    ) == (
        None,
        100,
        0.5,
        2,
    )
    a = "trainer.algorithm"
    lc = policy_objective(
        load_config(
            [
                f"{a}.policy_loss_type=clip_cov",
                f"{a}.clip_cov.clip_ratio=0.01",
                f"{a}.clip_cov.clip_cov_lb=0.5",
                f"{a}.clip_cov.clip_cov_ub=4",
                f"{a}.kl_cov.kl_cov_frac=0.1",
                f"{a}.kl_cov.ppo_kl_coef=2",
                f"{a}.sapo.tau_pos=0.9",
                f"{a}.sapo.tau_neg=1.2",
            ]
        )
    ).algorithm
    assert (
        lc.clip_cov.clip_ratio,
        lc.clip_cov.clip_cov_lb,
        lc.clip_cov.clip_cov_ub,
        lc.kl_cov.kl_cov_frac,
        lc.kl_cov.ppo_kl_coef,
    ) == (
        0.01,
        0.5,
        4,
        0.1,
        2,
    )
    assert (lc.sapo.tau_pos, lc.sapo.tau_neg) == (0.9, 1.2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "trainer.algorithm.use_tis=true",
                "trainer.algorithm.tis_imp_ratio_cap=2",
                "{p}.tis_ratio_type=token",
            ],
            "both ask for truncated importance sampling; set one",
        ),
        (["{p}.tis_ratio_type=tokens"], "tis_ratio_type='tokens' is not one of token, sequence"),
        (
            ["{p}.sequence_mask_metric=arithmetic"],
            "sequence_mask_metric='arithmetic' is not one of geometric, product",
        ),
        (["{p}.token_mask_is_threshold_low=0.5"], "token_mask_is_threshold_high must be set together"),
        (["{p}.geo_mask_low=1.05"], "geo_mask_low=1.05 must be <= {p}.geo_mask_high=1.01"),
        (["{p}.token_tis_ratio_clip_high=0"], "token_tis_ratio_clip_high=0.0 must be > 0"),
        (
            ["trainer.algorithm.clip_cov.clip_cov_lb=6"],
            "clip_cov_lb=6.0 must be < trainer.algorithm.clip_cov.clip_cov_ub=5.0",
        ),
        (["trainer.algorithm.sapo.tau_neg=0"], "sapo.tau_neg=0.0 must be > 0"),
        (["trainer.algorithm.kl_cov.kl_cov_frac=1.5"], "kl_cov_frac=1.5 must be in [0, 1]"),
        (["trainer.fully_async.enabled=true"], "needs a correction of the rollouts' staleness"),
    ],
)
def test_skyrl_loss_and_correction_settings_are_validated(overrides: list[str], message: str) -> None:
    p = "trainer.algorithm.off_policy_correction"
    with pytest.raises(ConfigError) as info:
        load_config([o.format(p=p) for o in overrides])
    assert message.format(p=p) in str(info.value)


def test_fully_async_accepts_skyrls_corrections_instead_of_use_tis() -> None:
    fa = ["trainer.fully_async.enabled=true"]
    load_config([*fa, "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric"])
    load_config([*fa, "trainer.algorithm.policy_loss_type=rollout_is"])
    load_config([*fa, "trainer.algorithm.policy_loss_type=dppo"])
    load_config([*fa, "trainer.algorithm.off_policy_correction.tis_ratio_type=token"])


def test_external_servers_translate_to_skylift_keys() -> None:
    ie = "generator.inference_engine"
    cfg = load_config([f"{ie}.external_server_urls=['127.0.0.1:8001','127.0.0.1:8002']"])
    assert not cfg.generator.run_engines_locally
    assert cfg.generator.remote_inference_engine_urls == ["127.0.0.1:8001", "127.0.0.1:8002"]
    cfg = load_config([f"{ie}.external_proxy_url=http://127.0.0.1:9000"])
    assert cfg.generator.remote_inference_engine_urls == ["http://127.0.0.1:9000"]


def test_engine_init_kwargs_reach_the_local_engines_under_both_names() -> None:
    from skylift.cluster.settings import local_engine_kwargs

    for key in ("generator.engine_init_kwargs", "generator.inference_engine.engine_init_kwargs"):
        cfg = load_config([f"{key}.max_model_len=2048", f"+{key}.swap_space=1"])
        kwargs = local_engine_kwargs(cfg, sleep_mode=False)
        assert kwargs["max_model_len"] == 2048 and kwargs["swap_space"] == 1


def test_skyrl_train_yaml_file_loads_as_a_config_file() -> None:
    import zipfile

    from skyrl_schema import _wheel

    with zipfile.ZipFile(_wheel("skyrl_train")) as zf:
        text = zf.read("skyrl_train/config/ppo_base_config.yaml").decode()
    path = Path(__file__).parent / "data" / "_ppo_base_config.yaml"
    try:
        path.write_text(text)
        cfg = load_config(config_file=path)
    finally:
        path.unlink(missing_ok=True)
    assert cfg.trainer.policy.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.trainer.placement.policy_num_gpus_per_node == 4 and cfg.generator.max_num_seqs == 1024


def test_an_empty_value_is_the_empty_string_as_hydra_reads_it(tmp_path: Path) -> None:
    """Issue 41, item 6: ``trainer.run_name=`` (SkyRL's turn-level-rewards script) is "", not null;
    the default directories then use skylift's default run name."""
    assert parse_override("trainer.run_name=") == ("trainer.run_name", "")
    cfg = load_config(["trainer.run_name=", f"trainer.runs_dir={tmp_path}"])
    assert cfg.trainer.run_name == ""
    assert cfg.trainer.log_dir == str(tmp_path / "skylift_run" / "logs")
    with pytest.raises(ConfigError, match="trainer.seed"):
        load_config(["trainer.seed="])  # an int key: "" is the wrong type, as in Hydra


def test_empty_external_server_keys_are_unset() -> None:
    """SkyRL's scripts pass ``external_server_urls=$URLS`` with the variable empty: no remote engines."""
    cfg = load_config(
        [
            "generator.inference_engine.external_proxy_url=",
            "generator.inference_engine.external_server_urls=",
        ]
    )
    default = load_config().generator
    assert cfg.generator.run_engines_locally
    assert cfg.generator.remote_inference_engine_urls == default.remote_inference_engine_urls


def test_skyrl_gym_group_is_skylifts_env_configs_on_the_command_line_and_in_files(tmp_path: Path) -> None:
    cfg = load_config(
        ["environment.skyrl_gym.text2sql.db_path=/data/db", "environment.skyrl_gym.max_env_workers=3"]
    )
    assert cfg.environment.env_configs == {"text2sql": {"db_path": "/data/db"}}
    assert cfg.environment.max_env_workers == 3
    config = tmp_path / "run.yaml"
    config.write_text("environment:\n  skyrl_gym:\n    search:\n      topk: 2\n")
    assert load_config([], config_file=config).environment.env_configs == {"search": {"topk": 2}}
    native = load_config(["environment.env_configs.search.topk=5"])
    assert native.environment.env_configs == {"search": {"topk": 5}}
