"""Dynamic sampling in a real run (tiny model, the session's shared `skylift serve`): half of the prompts always score 1, so
their groups carry no signal. `filter` trains only on the others and samples extra rounds to fill
the batch. `replace`, and either mode around one-step-off training, are asserted with fake parts
in tests/unit/test_rl_loop.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.envs import Environment, StepResult, register_env
from skylift.generator import Trajectory
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration


@register_env("test_constant_reward", override=True)
class ConstantRewardEnv(Environment):
    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=1.0, done=True)


@register_env("test_even_length_ds", override=True)
class EvenLengthEnv(Environment):
    """Random for the untrained tiny model: such groups usually have mixed rewards."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@pytest.fixture(scope="module")
def half_constant_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("half_constant")
    write_arithmetic_dataset(out, num_train=32, num_val=4, seed=0)
    table = pq.read_table(out / "train.parquet")
    envs = ["test_constant_reward" if i % 2 == 0 else "test_even_length_ds" for i in range(table.num_rows)]
    column = pa.array(envs)
    pq.write_table(
        table.set_column(table.schema.get_field_index("env_class"), "env_class", column),
        out / "train.parquet",
    )
    return out


def _run(
    data: Path, run_dir: Path, model: Path, server_url: str, **extra: object
) -> tuple[list[dict], list[list[Trajectory]], list[int]]:
    """The steps' metrics, the trajectories each update trained on, and the prompts of each
    generation call."""
    keys = {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(run_dir / "ckpts"),
        "trainer.export_path": str(run_dir / "exports"),
        "trainer.log_dir": str(run_dir / "logs"),
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        **extra,
    }
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in keys.items()]), console=False)
    trained: list[list[Trajectory]] = []
    round_sizes: list[int] = []
    update = trainer.update

    def recording_update(trajectories: list[Trajectory]) -> dict[str, float]:
        trained.append(list(trajectories))
        return update(trajectories)

    trainer.update = recording_update  # type: ignore[method-assign]
    sampler = trainer.source.sampler  # type: ignore[attr-defined]  # every training generation
    coroutine = sampler.coroutine

    def recording_coroutine(rows: list, step: int) -> Any:
        round_sizes.append(len(rows))
        return coroutine(rows, step)

    sampler.coroutine = recording_coroutine
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return [h for h in history if "reward/mean" in h], trained, round_sizes


def _row_index(uid: str) -> int:
    return int(uid.split("#")[0].split(":")[1])


def test_filter_trains_only_on_groups_with_a_signal(
    half_constant_data: Path, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    rows, trained, round_sizes = _run(
        half_constant_data,
        tmp_path,
        tiny_model_dir,
        tiny_server_url,
        **{
            "trainer.algorithm.dynamic_sampling.type": "filter",
            # oversampled rounds of 6 prompts: 3 of them at most carry a signal, so a step takes 2+
            "trainer.algorithm.dynamic_sampling.gen_batch_size": 6,
        },
    )
    assert len(rows) == 2 and len(trained) == 2
    rounds = [int(m["dynamic_sampling/rounds"]) for m in rows]
    assert round_sizes[: rounds[0]] == [6] * rounds[0]  # every round of step 1, the first included
    for metrics, batch in zip(rows, trained, strict=True):
        uids = {tr.uid for tr in batch}
        assert uids and all(_row_index(u) % 2 == 1 for u in uids), uids  # no constant-reward prompt
        assert sorted(tr.uid for tr in batch) == sorted(u for u in uids for _ in range(4))  # no prompt twice
        assert metrics["dynamic_sampling/groups_kept"] == len(uids)
        assert metrics["dynamic_sampling/groups_sampled"] == 6 * metrics["dynamic_sampling/rounds"]
        assert metrics["dynamic_sampling/rounds"] >= 2
        assert metrics["reward/mean"] < 1.0
