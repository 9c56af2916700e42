"""Constraints declared beside the fields (`Bounds` in schema.py) and checked by load_config."""

from __future__ import annotations

import dataclasses

import pytest

from skylift.config import ConfigError, SkyliftConfig, load_config
from skylift.config.fields import Bounds
from skylift.config.schema import LOGGERS


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("generator.sampling_params.min_p=1.5", "generator.sampling_params.min_p=1.5 must be in [0, 1]"),
        ("generator.eval_sampling_params.repetition_penalty=0", "repetition_penalty=0.0 must be > 0"),
        ("trainer.policy.model.lora.dropout=1.0", "trainer.policy.model.lora.dropout=1.0 must be in [0, 1)"),
        ("trainer.algorithm.kl_ctrl.horizon=0", "trainer.algorithm.kl_ctrl.horizon=0 must be >= 1"),
        ("trainer.algorithm.kl_ctrl.kl_target=0", "trainer.algorithm.kl_ctrl.kl_target=0.0 must be > 0"),
        ("trainer.algorithm.cispo.cispo_eps_clip_high=-1", "cispo_eps_clip_high=-1.0 must be >= 0"),
        ("trainer.max_ckpts_to_keep=0", "trainer.max_ckpts_to_keep=0 must be >= 1, or -1 to keep all"),
        ("generator.gpu_memory_utilization=0", "generator.gpu_memory_utilization=0.0 must be in (0, 1]"),
        ("trainer.critic.optimizer_config.scheduler=step", "scheduler='step' is not one of constant,"),
        (
            "trainer.algorithm.kl_ctrl.type=pid",
            "trainer.algorithm.kl_ctrl.type='pid' is not one of fixed, adaptive",
        ),
        ("environment.max_env_workers=-1", "environment.max_env_workers=-1 must be >= 0"),
        ("data.max_val_samples=0", "data.max_val_samples=0 must be >= 1"),
    ],
)
def test_a_value_outside_its_bounds_is_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert any(message in p for p in info.value.problems), info.value.problems


def test_bounds_check_each_item_of_a_list_and_let_null_pass() -> None:
    loggers = Bounds(choices=LOGGERS)
    assert loggers.problem("trainer.logger", ["console", "jsonl"]) is None
    assert loggers.problem("trainer.logger", ["console", "neptune"]) == (
        "trainer.logger='neptune' is not one of console, jsonl, tensorboard, wandb, mlflow"
    )
    assert Bounds(ge=1).problem("trainer.max_steps", None) is None
    assert Bounds(gt=0, lt=2).problem("k", 2) == "k=2 must be in (0, 2)"
    assert Bounds(le=5).problem("k", 6.5) == "k=6.5 must be <= 5"


def test_the_defaults_are_within_their_bounds() -> None:
    def walk(node: object, prefix: str) -> list[str]:
        found = []
        for f in dataclasses.fields(node):  # type: ignore[arg-type]
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                found += walk(value, f"{prefix}{f.name}.")
            elif "bounds" in f.metadata:
                problem = f.metadata["bounds"].problem(f"{prefix}{f.name}", value)
                found += [problem] if problem else []
        return found

    assert walk(SkyliftConfig(), "") == []
    assert walk(load_config(), "") == []


def test_runs_dir_places_the_default_outputs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("SKYLIFT_RUNS_DIR", str(tmp_path / "from_env"))
    assert load_config().trainer.ckpt_path == str(tmp_path / "from_env" / "skylift_run" / "ckpts")
    cfg = load_config([f"trainer.runs_dir={tmp_path / 'mine'}", "trainer.run_name=r1"])
    assert cfg.trainer.log_dir == str(tmp_path / "mine" / "r1" / "logs")  # the key wins over the variable
    with pytest.raises(ConfigError, match="ray_object_store_gb=0.0 must be > 0"):
        load_config(["trainer.ray_object_store_gb=0"])


def test_dynamic_sampling_bounds() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "trainer.algorithm.dynamic_sampling.type=sometimes",
                "trainer.algorithm.dynamic_sampling.max_sample_batches=0",
                "trainer.algorithm.dynamic_sampling.min_replace_ratio=2",
            ]
        )
    assert info.value.problems == [
        "trainer.algorithm.dynamic_sampling.type='sometimes' is not one of filter, replace",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=0 must be >= 1, or -1 for no limit",
        "trainer.algorithm.dynamic_sampling.min_replace_ratio=2.0 must be in [0, 1]",
    ]
    assert (
        load_config(["trainer.algorithm.dynamic_sampling.type=null"]).trainer.algorithm.dynamic_sampling.type
        is None
    )
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.algorithm.dynamic_sampling.gen_batch_size=16"])
    assert info.value.problems == [
        "trainer.algorithm.dynamic_sampling.gen_batch_size=16 oversamples for dynamic sampling and needs "
        "trainer.algorithm.dynamic_sampling.type set"
    ]
    with pytest.raises(ConfigError, match=r"gen_batch_size=4 must be >= trainer.train_batch_size=8"):
        load_config(
            [
                "trainer.train_batch_size=8",
                "trainer.algorithm.dynamic_sampling.type=filter",
                "trainer.algorithm.dynamic_sampling.gen_batch_size=4",
            ]
        )
