"""`skylift eval` (SkyRL's main_generate) against the session's tiny-model server reproduces a
training run's evaluations: 2 GRPO steps, evaluated, checkpointed and exported at each step; then
eval-only from the step-1 trainer checkpoint and from the step-2 export, each pushed to the server
by weight sync, gives the figures the run logged at that step, exactly (seeded sampling: the same
seeds, the same weights, the same batches). The server holds the other step's weights before each
eval-only run, and the two steps' evaluations differ, so a run that did not load its weights fails.
Also: the figures under skylift's and SkyRL's names, logged at step 0, each sample dumped (skylift's
and SkyRL's layouts: SkyRL's files of the eval-only run equal the run's own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.compat.skyrl.eval_dump import AGGREGATED
from skylift.config import load_config
from skylift.data import write_addition_demo
from skylift.envs import Environment, StepResult, register_env
from skylift.rl.build import build_trainer
from skylift.rl.eval_only import DUMP_NAME, EvalOnlyRun

pytestmark = pytest.mark.integration

ENV = "test_eval_odd_length"


@register_env(ENV, override=True)
class OddLengthEnv(Environment):
    """Reward 1 for a response of odd character length: random for the untrained tiny model, so
    GRPO groups get non-zero advantages and the weights move."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 1), done=True)


def _data(out: Path) -> Path:
    write_addition_demo(out, num_train=4, num_val=4, seed=0)
    for split in ("train", "validation"):
        table = pq.read_table(out / f"{split}.parquet")
        column = pa.array([ENV] * table.num_rows)
        pq.write_table(
            table.set_column(table.schema.get_field_index("env_class"), "env_class", column),
            out / f"{split}.parquet",
        )
    return out


def _keys(data: Path, model: Path, server_url: str, run: Path) -> dict[str, Any]:
    return {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "generator.eval_n_samples_per_prompt": 2,
        "generator.eval_sampling_params.temperature": 1.0,
        "generator.seeded_sampling": True,
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.epochs": 2,  # 4 prompts: one batch an epoch
        "trainer.eval_before_train": False,
        "trainer.eval_interval": 1,
        "trainer.ckpt_interval": 1,
        "trainer.hf_save_interval": 1,
        "trainer.dump_eval_results": True,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(run / "ckpts"),
        "trainer.export_path": str(run / "exports"),
        "trainer.log_dir": str(run / "logs"),
        "trainer.runs_dir": str(run / "runs"),
    }


def _config(keys: dict[str, Any]) -> Any:
    return load_config([f"{k}={v}" for k, v in keys.items()])


def _eval_only(keys: dict[str, Any], checkpoint: Path, said: list[str]) -> dict[str, float]:
    run = EvalOnlyRun(_config(keys), said.append, checkpoint=checkpoint)
    try:
        run.setup()
        return run.evaluate()
    finally:
        run.shutdown()


def _figures(metrics: dict[str, float]) -> dict[str, float]:
    """The evaluation's figures but its wall-clock times (SkyRL's `generate/trajectory_time_*`)."""
    return {k: v for k, v in metrics.items() if k.startswith("eval/") and "/trajectory_time_" not in k}


def _responses(dump: Path) -> list[tuple[str, str]]:
    return [(r["uid"], r["response"]) for r in map(json.loads, dump.read_text().splitlines())]


def test_eval_only_reproduces_the_runs_evaluations_from_its_checkpoint_and_export(
    tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    keys = _keys(_data(tmp_path / "data"), tiny_model_dir, tiny_server_url, tmp_path / "train")
    trainer = build_trainer(_config(keys), console=False)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    trained = {h["step"]: _figures(h) for h in history if "eval/accuracy" in h}
    assert sorted(trained) == [1, 2] and "eval/all/pass_at_2" in trained[1]
    train_dumps = tmp_path / "train" / "logs" / "eval"
    step1, step2 = (_responses(train_dumps / f"step_{s}.jsonl") for s in (1, 2))
    assert step1 != step2  # the steps' weights sample differently: each check below can fail

    eval_keys = {**keys, "trainer.log_dir": str(tmp_path / "eval" / "logs")}
    said: list[str] = []
    # the server holds step 2's weights: the step-1 checkpoint must be loaded and pushed
    from_ckpt = _eval_only(eval_keys, tmp_path / "train" / "ckpts" / "global_step_1", said)
    assert _figures(from_ckpt) == trained[1]
    assert _responses(tmp_path / "eval" / "logs" / "eval" / DUMP_NAME) == step1
    skyrl_dumps = tmp_path / "train" / "exports" / "dumped_evals"  # SkyRL's dump_eval_results layout
    for name in (AGGREGATED, "skylift_addition-demo.jsonl"):
        eval_only, at_step_1 = (skyrl_dumps / d / name for d in ("eval_only", "global_step_1_evals"))
        if name == AGGREGATED:  # the figures, wall-clock times aside
            rows = [
                [_figures(json.loads(line)) for line in f.read_text().splitlines()]
                for f in (eval_only, at_step_1)
            ]
            assert rows[0] == rows[1] and rows[0], name
        else:
            assert eval_only.read_text() == at_step_1.read_text(), name
    # now it holds step 1's: the step-2 export must be pushed
    from_export = _eval_only(eval_keys, tmp_path / "train" / "exports" / "global_step_2", said)
    assert _figures(from_export) == trained[2]
    assert _responses(tmp_path / "eval" / "logs" / "eval" / DUMP_NAME) == step2

    assert (
        from_ckpt["eval/accuracy"] == from_ckpt["eval/all/avg_score"] and "eval/accuracy_stderr" in from_ckpt
    )
    assert "eval/skylift_addition-demo/avg_score" in from_ckpt
    rows = [
        json.loads(line) for line in (tmp_path / "eval" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 0] and rows[1]["eval/all/pass_at_2"] == from_export[
        "eval/all/pass_at_2"
    ]
    dumped = (tmp_path / "eval" / "logs" / "eval" / DUMP_NAME).read_text().splitlines()
    assert len(dumped) == 8 and json.loads(dumped[0])["data_source"] == "skylift/addition-demo"
    assert any("evaluating the trainer checkpoint" in line and "(step 1)" in line for line in said)
    assert any("evaluating the Hugging Face directory" in line for line in said)
    assert any(line.startswith("eval accuracy ") for line in said)
    assert any("evaluation only" in line for line in said)
