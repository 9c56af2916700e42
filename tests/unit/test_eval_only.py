"""Evaluation as SkyRL users run it: SkyRL's metric names (eval/all/avg_score,
eval/<data_source>/avg_score, eval/all/pass_at_<n>) beside skylift's eval/accuracy, per data
source, in the training loop's evaluation and in the eval-only command (`skylift eval`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rl_fakes import FakeGenerator, FakeTracker, fake_config, fake_decode, fake_run

from skylift.cluster.placement import PlacementRequest, plan_placement
from skylift.compat.skyrl.metrics import skyrl_figures, skyrl_source_name
from skylift.data import PromptSample
from skylift.entrypoints.main_base import RunOptions
from skylift.entrypoints.main_generate import run_eval
from skylift.rl.eval_only import DUMP_NAME, eval_sampler, evaluate_once, summary
from skylift.utils.eval_stats import standard_error
from skylift.utils.loop_thread import LoopThread

SOURCES = ["openai/gsm8k", "openai/gsm8k", "math", ""]  # the 4th row has no data source


def _rows() -> list[PromptSample]:
    return [
        PromptSample([{"role": "user", "content": f"q{i}"}], "gsm8k", {}, {}, src, f"0:{i}")
        for i, src in enumerate(SOURCES)
    ]


def _reward(row: int, sample: int, version: int) -> float:
    """Rewards per prompt: [1, 0], [0, 0], [1, 1], [-1, -1] (with 2 samples)."""
    if row == 2 or (row == 0 and sample == 0):
        return 1.0
    return -1.0 if row == 3 else 0.0


def test_skyrl_figures_follow_skyrl_definitions() -> None:
    groups = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [-1.0, -1.0]]
    figures = skyrl_figures(groups, "eval/all/", 2)
    assert figures == pytest.approx(
        {"eval/all/avg_score": 1 / 8, "eval/all/pass_at_2": 2 / 4, "eval/all/mean_positive_reward": 3 / 8}
    )
    assert skyrl_figures([], "eval/all/", 2) == {}
    assert skyrl_figures([[0.3]], "x/", 1)["x/pass_at_1"] == 1.0  # any positive reward passes
    assert [skyrl_source_name(s) for s in ("openai/gsm8k", "", None)] == [
        "openai_gsm8k",
        "unknown",
        "unknown",
    ]


def test_eval_only_logs_skyrl_and_skylift_figures_per_data_source(tmp_path: Path) -> None:
    cfg = fake_config(
        tmp_path,
        "generator.eval_n_samples_per_prompt=2",
        "trainer.eval_batch_size=3",
        "trainer.dump_eval_results=true",
    )
    generator, tracker, loop = FakeGenerator(reward=_reward), FakeTracker(), LoopThread()
    try:
        sampler = eval_sampler(cfg, generator, loop)
        metrics = evaluate_once(
            cfg, _rows(), sampler, tracker, tmp_path / "logs", (tmp_path / "exports", fake_decode)
        )
    finally:
        loop.stop()
    # prompts in batches of eval_batch_size, n samples each, engines at version 0
    assert [(c.rows, c.n, c.version) for c in generator.calls] == [([0, 1, 2], 2, 0), ([3], 2, 0)]
    assert tracker.logged == [(0, metrics)]  # logged once, at step 0, as SkyRL's main_generate
    expected = {
        "eval/all/avg_score": 1 / 8,
        "eval/all/pass_at_2": 0.5,
        "eval/all/mean_positive_reward": 3 / 8,
        "eval/openai_gsm8k/avg_score": 0.25,
        "eval/openai_gsm8k/pass_at_2": 0.5,
        "eval/math/avg_score": 1.0,
        "eval/math/pass_at_2": 1.0,
        "eval/unknown/avg_score": -1.0,
        "eval/unknown/pass_at_2": 0.0,
        "eval/unknown/mean_positive_reward": 0.0,
        # skylift's own figures, with the standard error over prompts
        "eval/accuracy": 1 / 8,
        "eval/accuracy_stderr": standard_error([0.5, 0.0, 1.0, -1.0]),
        "eval/pass@2": 0.25,  # skylift's pass@n: the mean of each prompt's best reward
        "eval/openai/gsm8k/accuracy": 0.25,
        "eval/unknown/accuracy": -1.0,
    }
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    dumped = [json.loads(line) for line in (tmp_path / "logs" / "eval" / DUMP_NAME).read_text().splitlines()]
    assert [(d["uid"], d["data_source"], d["reward"]) for d in dumped][:2] == [
        ("0:0", "openai/gsm8k", 1.0),
        ("0:0", "openai/gsm8k", 0.0),
    ]
    assert len(dumped) == 8
    lines = summary(metrics, 2)
    assert lines[0].startswith("eval accuracy 12% ± ") and "eval/all/pass_at_2 0.5000" in lines
    assert 0 < metrics["timing/eval_generate"] <= metrics["timing/eval_s"]  # SkyRL's name


def test_eval_only_dumps_as_skyrl_dumps(tmp_path: Path) -> None:
    """SkyRL's `dump_eval_results` layout: `<export_path>/dumped_evals/eval_only/<data_source>.jsonl`
    (SkyRL's entry keys) and `aggregated_results.jsonl` (the eval/* figures)."""
    cfg = fake_config(tmp_path, "generator.eval_n_samples_per_prompt=2", "trainer.dump_eval_results=true")
    loop = LoopThread()
    try:
        sampler = eval_sampler(cfg, FakeGenerator(reward=_reward), loop)
        metrics = evaluate_once(
            cfg, _rows(), sampler, FakeTracker(), tmp_path / "logs", (tmp_path / "exports", fake_decode)
        )
    finally:
        loop.stop()
    out = tmp_path / "exports" / "dumped_evals" / "eval_only"
    assert sorted(p.name for p in out.iterdir()) == [
        "aggregated_results.jsonl",
        "math.jsonl",
        "openai_gsm8k.jsonl",
        "unknown.jsonl",
    ]
    gsm8k = [json.loads(line) for line in (out / "openai_gsm8k.jsonl").read_text().splitlines()]
    assert len(gsm8k) == 4 and set(gsm8k[0]) == {
        "input_prompt",
        "output_response",
        "score",
        "stop_reason",
        "env_class",
        "env_extras",
        "data_source",
    }
    assert [e["score"] for e in gsm8k] == [1.0, 0.0, 0.0, 0.0]
    first = gsm8k[0]
    assert first["input_prompt"] == "5 6 7" and first["env_class"] == "gsm8k"
    assert first["data_source"] == "openai/gsm8k" and first["env_extras"]["uid"] == "0:0"
    unknown = [json.loads(line) for line in (out / "unknown.jsonl").read_text().splitlines()]
    assert {e["data_source"] for e in unknown} == {"unknown"} and len(unknown) == 2
    (aggregated,) = [json.loads(line) for line in (out / "aggregated_results.jsonl").read_text().splitlines()]
    assert aggregated == {k: v for k, v in metrics.items() if k.startswith("eval/")}
    assert aggregated["eval/all/avg_score"] == pytest.approx(1 / 8)


def test_training_evaluation_logs_skyrl_names_too(tmp_path: Path) -> None:
    run = fake_run(
        tmp_path,
        "trainer.eval_interval=2",
        "trainer.eval_before_train=true",
        "generator.eval_n_samples_per_prompt=1",
        "trainer.dump_eval_results=true",
    )
    history = run.trainer.fit()
    run.close()
    evals = [h for h in history if "eval/accuracy" in h]
    assert [h["step"] for h in evals] == [0, 2, 4]
    dumps = tmp_path / "exports" / "dumped_evals"  # SkyRL's dump of each evaluation
    assert sorted(p.name for p in dumps.iterdir()) == [f"global_step_{s}_evals" for s in (0, 2, 4)]
    aggregated = json.loads((dumps / "global_step_2_evals" / "aggregated_results.jsonl").read_text())
    assert aggregated["eval/all/avg_score"] == evals[1]["eval/all/avg_score"]
    assert len((dumps / "global_step_2_evals" / "skylift_addition-demo.jsonl").read_text().splitlines()) == 4
    for h in evals:
        assert h["eval/all/avg_score"] == pytest.approx(h["eval/accuracy"])
        assert h["eval/skylift_addition-demo/avg_score"] == pytest.approx(h["eval/accuracy"])
        assert "eval/all/pass_at_1" in h and "eval/all/mean_positive_reward" in h
        assert "eval/pass@1" not in h  # skylift's pass@n only with several samples


SKYRL_GENERATION_GSM8K = [  # SkyRL's examples/train/gsm8k/run_generation_gsm8k.sh (head)
    "data.val_data=['/data/gsm8k/validation.parquet']",
    "trainer.policy.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "trainer.logger=wandb",
    "trainer.placement.colocate_all=false",
    "generator.inference_engine.backend=vllm",
    "generator.inference_engine.num_engines=1",
    "generator.inference_engine.tensor_parallel_size=1",
    "generator.inference_engine.gpu_memory_utilization=0.9",
    "generator.eval_sampling_params.max_generate_length=1024",
    "generator.eval_sampling_params.temperature=0.7",
    "environment.env_class=gsm8k",
]


def test_skyrl_generation_command_is_accepted_and_no_eval_data_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_eval(RunOptions(SKYRL_GENERATION_GSM8K, dry_run=True)) == 0
    out = capsys.readouterr()
    assert "dry run: the configuration is valid" in out.err
    assert run_eval(RunOptions(["data.val_data=[]"], dry_run=True)) == 2
    assert "skylift eval needs evaluation prompts: set data.val_data" in capsys.readouterr().err
    assert (
        run_eval(RunOptions(["trainer.policy.megatron_config.tensor_model_parallel_size=2"], dry_run=True))
        == 2
    )
    assert "skylift has no Megatron backend" in capsys.readouterr().err


def _generation_commands(fixture: str) -> list[list[str]]:
    """The overrides of each `main_generate` command of a SkyRL example fixture."""
    out: list[list[str]] = []
    current: list[str] | None = None
    for line in (Path(__file__).parent / "data" / fixture).read_text().splitlines():
        if line.startswith("# "):
            current = [] if line.endswith(".main_generate") else None
            if current is not None:
                out.append(current)
        elif line and current is not None:
            current.append(line)
    return out


@pytest.mark.parametrize("fixture", ["skyrl_commands_head.txt", "skyrl_commands_0.4.0.txt"])
def test_skyrls_generation_commands_run_as_skylift_eval(
    fixture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every `main_generate` command of SkyRL's examples is a valid `skylift eval` command line."""
    commands = _generation_commands(fixture)
    assert len(commands) == 1 and len(commands[0]) >= 8
    for overrides in commands:
        assert run_eval(RunOptions(overrides, dry_run=True)) == 0, capsys.readouterr().err


def test_eval_only_placement_reserves_the_engines_only() -> None:
    plan = plan_placement(PlacementRequest(with_policy=False, num_engines=2, engine_tp=2))
    assert [g.name for g in plan.groups] == ["engine-0", "engine-1"]
    assert {role for role, _rank in plan.slots} == {"engine-0", "engine-1"}
