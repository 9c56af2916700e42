"""The RL loop end to end on the tiny model: local engines (Ray) and a remote server, with
evaluation, checkpoints, resume and the Hugging Face export."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.envs import Environment, StepResult, register_env
from skylift.rl import checkpoint as ckpt
from skylift.rl.build import build_trainer
from skylift.rl.loop import RLTrainer

pytestmark = pytest.mark.integration


@register_env("test_even_length", override=True)
class EvenLengthEnv(Environment):
    """Reward 1 for a response of even character length: random for the untrained tiny model, so
    GRPO groups get non-zero advantages (arithmetic rewards would all be 0)."""

    def step(self, action: str) -> StepResult:
        self._begin_step()
        self.done = True
        return StepResult(observations=[], reward=float(len(action) % 2 == 0), done=True)


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    write_arithmetic_dataset(out, num_train=32, num_val=8, seed=0)
    for split in ("train", "validation"):  # score with the user-registered environment above
        table = pq.read_table(out / f"{split}.parquet")
        column = pa.array(["test_even_length"] * table.num_rows)
        pq.write_table(
            table.set_column(table.schema.get_field_index("env_class"), "env_class", column),
            out / f"{split}.parquet",
        )
    return out


def _overrides(data: Path, run_dir: Path, tiny_model_dir: Path, **extra: object) -> list[str]:
    base = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 2,  # two optimizer steps per training step
        "trainer.micro_train_batch_size_per_gpu": 3,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.eval_batch_size": 8,
        "trainer.eval_interval": 2,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.ckpt_path": str(run_dir / "ckpts"),
        "trainer.export_path": str(run_dir / "exports"),
        "trainer.log_dir": str(run_dir / "logs"),
        "trainer.logger": "['console','tensorboard']",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _run(overrides: list[str]) -> tuple[RLTrainer, list[dict], str]:
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        history = trainer.fit()
        exported = trainer.export()
    finally:
        trainer.shutdown()
    return trainer, history, exported


def _check_steps(history: list[dict], steps: list[int]) -> None:
    train_rows = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in train_rows] == steps
    for row in train_rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["response_length/mean"] > 0
        # the trainer's logprobs of the sampled tokens match the engine's (fp32)
        assert row["policy/logprob_diff_vs_rollout"] < 1e-3
        assert row["policy/grad_norm"] > 0  # even-length rewards differ within groups


def _check_records_report_and_trace(run_dir: Path, history: list[dict]) -> None:
    """What the run recorded for `skylift view` (real tokens, the trainer's and the engine's
    logprobs), the report built from it, the sample table in tensorboard, the profiler's trace."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from skylift.viewer import build_report

    records = run_dir / "logs" / "rollouts"
    names = sorted(p.name for p in records.iterdir())
    assert names == ["eval_step_0.json", "eval_step_2.json", "train_step_1.json", "train_step_2.json"]
    record = json.loads((records / "train_step_2.json").read_text())
    samples = [s for g in record["groups"] for s in g["samples"]]
    assert len(record["groups"]) == 4 and len(samples) == 16  # 4 groups of 4 (train_batch_size=4)
    for sample in samples:
        (turn,) = sample["segments"]
        assert len(turn["tokens"]) == len(turn["diff"]) == sample["length"] > 0
        assert sample["max_abs_diff"] < 1e-3  # fp32 trainer and engine agree token by token
    index = (build_report(run_dir).parent / "data" / "index.js").read_text()
    assert '"name": "train_step_2"' in index and '"timings": [{"step": 1' in index
    events = EventAccumulator(str(run_dir / "logs" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("samples/train/text_summary")] == [1, 2]
    trace = run_dir / "logs" / "profiles" / "rank_0_step_2.pt.trace.json"
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]
    assert any(
        e.get("name", "").startswith("skylift/train_step_2")
        for e in json.loads(trace.read_text())["traceEvents"]
    )
    train = [h for h in history if "timing/step_s" in h]
    assert all(0 < h["timing/rollout_records_s"] < h["timing/step_s"] for h in train)


def test_two_steps_with_local_engines(arithmetic_data: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    key = "trainer.policy.torch_profiler_config"
    profile = {f"{key}.enable": "true", f"{key}.skip_first": 1, f"{key}.warmup": 0}  # trace step 2
    overrides = _overrides(
        arithmetic_data,
        tmp_path,
        tiny_model_dir,
        **{"trainer.max_steps": 2, "trainer.ckpt_interval": 2},
        **profile,
    )
    trainer, history, exported = _run(overrides)
    _check_steps(history, [1, 2])
    # auto: in-process rank 0, engine on this host, /dev/shm holds the weights: shared memory
    assert trainer.parts.weights.transport.chosen == "ipc"
    _check_records_report_and_trace(tmp_path, history)
    evals = [h for h in history if "eval/accuracy" in h]
    assert [h["step"] for h in evals] == [0, 2]  # before training and at the last step
    assert ckpt.latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "global_step_2"
    assert (tmp_path / "logs" / "tensorboard").is_dir()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.tie_word_embeddings is False


def test_remote_server_ppo_with_critic_then_resume(
    arithmetic_data: Path, tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    """PPO (gae advantages from a critic) against a remote server; policy and critic resume."""
    url = tiny_server_url.removeprefix("http://")
    remote = {
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{url}']",
        "generator.override_existing_update_group": True,
        "trainer.ckpt_interval": 1,
        "trainer.resume_mode": "latest",
        "trainer.algorithm.advantage_estimator": "gae",
        "trainer.critic_mini_batch_size": 2,
        "trainer.critic.optimizer_config.lr": 1e-3,
    }
    _, first, _ = _run(
        _overrides(arithmetic_data, tmp_path, tiny_model_dir, **remote, **{"trainer.max_steps": 2})
    )
    _check_steps(first, [1, 2])
    for row in (h for h in first if "reward/mean" in h):
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
    assert (tmp_path / "ckpts" / "global_step_2" / "critic").is_dir()
    # a half-written checkpoint must never be picked by resume
    (tmp_path / "ckpts" / "global_step_9.partial").mkdir()
    (tmp_path / "ckpts" / "global_step_7").mkdir()  # no COMPLETE marker
    trainer, second, _ = _run(
        _overrides(arithmetic_data, tmp_path, tiny_model_dir, **remote, **{"trainer.max_steps": 3})
    )
    _check_steps(second, [3])  # continued after step 2, no evaluation before training
    assert trainer.state.global_step == 3
    assert ckpt.load_trainer_state(tmp_path / "ckpts" / "global_step_3").policy_version == 3


def test_bfloat16_engines_with_mixed_precision_training(
    arithmetic_data: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The demo's precision: bf16 engines sampling, bf16 matmuls over float32 weights training, and
    weights sent to the engines cast to bf16. Rollout and trainer logprobs then differ by bf16
    round-off only, also after the weights have moved (each sync reached the engine)."""
    overrides = _overrides(
        arithmetic_data,
        tmp_path,
        tiny_model_dir,
        **{
            "trainer.max_steps": 3,
            "trainer.eval_interval": -1,
            "trainer.eval_before_train": False,
            "trainer.placement.backend": "local",
            "generator.model_dtype": "bfloat16",
            "trainer.bf16": True,
            "trainer.policy.optimizer_config.lr": 3e-3,
        },
    )
    _, history, _ = _run(overrides)
    rows = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in rows] == [1, 2, 3]
    diffs = [h["policy/logprob_diff_vs_rollout"] for h in rows]
    print("bf16 |lp diff| per step:", diffs)
    assert all(0 < d < 2e-2 for d in diffs), diffs
