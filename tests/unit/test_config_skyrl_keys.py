"""SkyRL's keys one by one on skylift: both spellings of renamed keys, what is refused and how,
the loss and off-policy settings reaching the policy loss, SkyRL's files and empty values
(the schemas and SkyRL's example commands as a whole: test_config_skyrl.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from skylift.config import ConfigError, load_config
from skylift.config.loading import parse_override

MEGATRON = "skylift has no Megatron backend"


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
