"""Evaluation figures: accuracy with its standard error, pass@n and majority voting (maj@n)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from skylift.data import PromptSample
from skylift.demo import accuracy_cell
from skylift.generator import Trajectory
from skylift.rl.console import step_summary
from skylift.rl.evaluation import answer_of, evaluate
from skylift.tracking.plot import accuracy_series, plot_run
from skylift.utils.eval_stats import Sample, accuracy_figures, format_accuracy, majority_score, standard_error


def test_one_sample_per_prompt_gives_the_binomial_standard_error() -> None:
    groups = [[Sample(1.0)]] * 70 + [[Sample(0.0)]] * 30
    figures = accuracy_figures(groups, "eval/")
    assert figures["eval/accuracy"] == pytest.approx(0.7)
    assert figures["eval/accuracy_stderr"] == pytest.approx(math.sqrt(0.7 * 0.3 / 100))  # 0.0458
    assert set(figures) == {"eval/accuracy", "eval/accuracy_stderr"}  # no pass@1 / maj@1 copies
    assert format_accuracy(0.7, figures["eval/accuracy_stderr"]) == "70% ± 4.6"
    assert standard_error([1.0]) == 0.0 and standard_error([]) == 0.0


def test_several_samples_per_prompt_give_pass_and_majority_figures() -> None:
    groups = [
        [Sample(1.0, "5"), Sample(0.0, "6"), Sample(0.0, "6"), Sample(1.0, "5")],  # tie: "5" came first
        [Sample(0.0, "3"), Sample(0.0, "3"), Sample(1.0, "4"), Sample(0.0, None)],  # majority wrong
        [Sample(0.0, None)] * 4,  # no answer at all
        [Sample(1.0, "7"), Sample(1.0, "7"), Sample(0.0, "8"), Sample(1.0, "7")],
    ]
    figures = accuracy_figures(groups, "eval/")
    assert figures["eval/accuracy"] == pytest.approx(6 / 16)
    assert figures["eval/pass@4"] == pytest.approx(3 / 4)
    assert figures["eval/maj@4"] == pytest.approx(2 / 4)
    assert figures["eval/maj@4_stderr"] == pytest.approx(math.sqrt(0.25 / 4))
    # the accuracy's standard error treats prompts, not samples, as independent
    means = [0.5, 0.25, 0.0, 0.75]
    spread = sum((m - 0.375) ** 2 for m in means) / 4
    assert figures["eval/accuracy_stderr"] == pytest.approx(math.sqrt(spread / 4))
    assert majority_score([Sample(0.0, "x"), Sample(1.0, "y"), Sample(1.0, "y")]) == 1.0


def _trajectory(uid: str, reward: float, text: str, source: str, parsed: str | None = "") -> Trajectory:
    metadata = {} if parsed == "" else {"parsed_answer": parsed}
    return Trajectory(
        uid=uid,
        prompt_ids=[1],
        response_ids=[2, 3],
        loss_mask=[1, 1],
        rollout_logprobs=[0.0, 0.0],
        reward=reward,
        stop_reason="stop",
        data_source=source,
        env_metadata=metadata,
        response_text=text,
    )


def test_evaluation_reports_figures_overall_and_per_source() -> None:
    rows = [
        PromptSample([{"role": "user", "content": str(i)}], "final_answer", {}, {}, "", uid=f"p{i}")
        for i in range(3)
    ]
    answers = {  # uid -> (source, [(reward, text, parsed answer)])
        "p0": ("a", [(1.0, "#### 5", "5"), (0.0, "#### 6", "6"), (1.0, "#### 5", "5")]),
        "p1": ("a", [(0.0, "#### 1", "1"), (0.0, "no idea", None), (0.0, "#### 1", "1")]),
        "p2": ("b", [(1.0, " yes ", ""), (0.0, "no", ""), (1.0, "yes", "")]),  # no parsed answer
    }

    def generate(batch: list[PromptSample]) -> list[Trajectory]:
        return [
            _trajectory(r.uid, reward, text, answers[r.uid][0], parsed)
            for r in batch
            for reward, text, parsed in answers[r.uid][1]
        ]

    metrics, trajectories = evaluate(rows, generate, batch_size=2)
    assert len(trajectories) == 9
    assert metrics["eval/accuracy"] == pytest.approx(4 / 9)
    assert metrics["eval/pass@3"] == pytest.approx(2 / 3)
    assert metrics["eval/maj@3"] == pytest.approx(2 / 3)  # p2 votes on the stripped text: "yes"
    assert metrics["eval/a/accuracy"] == pytest.approx(2 / 6)
    assert metrics["eval/a/maj@3"] == pytest.approx(1 / 2)
    assert metrics["eval/b/pass@3_stderr"] == 0.0  # one prompt
    assert {"eval/accuracy_stderr", "eval/a/accuracy_stderr", "eval/b/accuracy_stderr"} <= set(metrics)
    assert answer_of(trajectories[4]) is None  # the environment found no answer: no vote


def test_figures_are_shown_with_their_standard_error(tmp_path: Path) -> None:
    metrics = {"eval/accuracy": 0.7, "eval/accuracy_stderr": 0.0458}
    assert accuracy_cell(metrics) == "70% ± 4.6"
    timings = {f"timing/{k}_s": 1.0 for k in ("generate", "wait", "train", "weight_sync", "idle")}
    line = step_summary(1, 2, {"reward/mean": 0.5, "response_length/mean": 3.0, **timings, **metrics})
    assert "eval acc 0.700 ± 0.046" in line
    rows = [{"step": 0, **metrics, "eval/all/accuracy": 0.7, "eval/all/accuracy_stderr": 0.0458}]
    assert accuracy_series(rows) == ["eval/accuracy"]  # standard errors are error bars, not series
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.7, "eval/accuracy_stderr": 0.05}\n')
    assert plot_run(logs).is_file()
