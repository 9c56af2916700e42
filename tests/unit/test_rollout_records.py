"""`trainer.rollout_records`: what the training loop records for `skylift view` and the trackers'
sample tables, at its interval and within its size cap (fake parts; the writer's own output on
real generator trajectories is checked in test_viewer.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rl_fakes import FakeGenerator, fake_run
from viewer_runs import write_run

from skylift.rl.rollout_records import RECORDS_DIR, table_rows


class SampleTables:
    """A tracker that keeps the sample tables it is given (and the scalars)."""

    def __init__(self) -> None:
        self.tables: list[tuple[str, int, list[dict[str, Any]]]] = []
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def log_samples(self, rows: list[dict[str, Any]], step: int, key: str) -> None:
        self.tables.append((key, step, rows))


def _records(root: Path) -> list[str]:
    folder = root / "logs" / RECORDS_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_each_step_and_evaluation_is_recorded_with_its_samples(tmp_path: Path) -> None:
    tables = SampleTables()
    run = fake_run(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.eval_interval=2",
        "trainer.eval_before_train=true",
        "trainer.rollout_records.groups_per_step=3",
        "trainer.rollout_records.tracker_rows=5",
        tracking=tables,
    )
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert _records(tmp_path) == [
        "eval_step_0.json",
        "eval_step_2.json",
        "train_step_1.json",
        "train_step_2.json",
    ]
    assert all(0 <= h["timing/rollout_records_s"] < h["timing/step_s"] for h in history)
    record = json.loads((tmp_path / "logs" / RECORDS_DIR / "train_step_1.json").read_text())
    assert record["kind"] == "train" and record["step"] == 1
    groups = record["groups"]
    assert len(groups) == 3 and all(len(g["samples"]) == 2 for g in groups)  # n_samples_per_prompt=2
    for group in groups:
        assert group["messages"][-1]["role"] == "user" and "What is" in group["messages"][-1]["content"]
        assert group["prompt_text"] == "5 6 7"  # the fakes' prompt ids, decoded
        rewards = [s["reward"] for s in group["samples"]]
        advantages = [s["advantage"] for s in group["samples"]]
        assert rewards == [0.0, 1.0] and advantages[0] < 0 < advantages[1]  # GRPO in the group
        for sample in group["samples"]:
            (segment,) = sample["segments"]  # one assistant turn
            assert segment["role"] == "assistant" and len(segment["tokens"]) == sample["length"] == 4
            # one update a step: no PPO anchor pass, so the recorded rows get a forward of their
            # own; the fake policy's logprobs are the engine's, so the gap is 0 on every token
            assert segment["diff"] == [0.0] * 4 and sample["max_abs_diff"] == 0.0
    # the forward pass runs every logprob_interval (10) steps: step 2 has no gap to show
    second = json.loads((tmp_path / "logs" / RECORDS_DIR / "train_step_2.json").read_text())
    assert all(s["segments"][0]["diff"] is None for g in second["groups"] for s in g["samples"])
    assert all(s["max_abs_diff"] is None for g in second["groups"] for s in g["samples"])
    evaluation = json.loads((tmp_path / "logs" / RECORDS_DIR / "eval_step_0.json").read_text())
    assert evaluation["kind"] == "eval" and all(
        "correct" in s for g in evaluation["groups"] for s in g["samples"]
    )
    keys = [(key, step) for key, step, _ in tables.tables]
    assert keys == [("samples/eval", 0), ("samples/train", 1), ("samples/train", 2), ("samples/eval", 2)]
    assert all(len(rows) <= 5 for _, _, rows in tables.tables)
    assert tables.tables[1][2] == table_rows("train", 1, groups)[:5]


def test_the_experiences_own_trainer_logprobs_are_used_when_it_has_them(tmp_path: Path) -> None:
    """Two mini-batches: the PPO anchor is the trainer's pass before the update; no extra forward."""
    run = fake_run(tmp_path, "trainer.max_steps=1", "trainer.policy_mini_batch_size=2")
    calls: list[int] = []
    forward = run.policy.compute_logprobs
    run.policy.compute_logprobs = lambda batch, *a: calls.append(batch.batch_size) or forward(batch, *a)  # type: ignore[method-assign]
    try:
        run.trainer.fit()
    finally:
        run.close()
    assert calls == [8]  # the anchor pass over the whole batch, nothing for the records
    record = json.loads((tmp_path / "logs" / RECORDS_DIR / "train_step_1.json").read_text())
    assert all(s["segments"][0]["diff"] == [0.0] * 4 for g in record["groups"] for s in g["samples"])


def test_the_interval_and_off(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "a", "trainer.max_steps=4", "trainer.rollout_records.interval=2")
    try:
        run.trainer.fit()
    finally:
        run.close()
    assert _records(tmp_path / "a") == ["train_step_2.json", "train_step_4.json"]
    run = fake_run(tmp_path / "b", "trainer.max_steps=2", "trainer.rollout_records.interval=0")
    try:
        history = run.trainer.fit()
    finally:
        run.close()
    assert _records(tmp_path / "b") == [] and not any("timing/rollout_records_s" in h for h in history)


def test_recording_stops_at_the_size_cap_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=4", "trainer.rollout_records.max_mb=0.004")  # ~4 KB
    run.trainer.console.enabled = True
    try:
        run.trainer.fit()
    finally:
        run.close()
    names = _records(tmp_path)
    assert 1 <= len(names) < 4
    assert sum((tmp_path / "logs" / RECORDS_DIR / n).stat().st_size for n in names) <= 0.004 * 2**20
    out = capsys.readouterr().out
    assert out.count("rollout records reached trainer.rollout_records.max_mb=0.004") == 1


def test_multi_turn_tool_samples_become_assistant_and_tool_turns(tmp_path: Path) -> None:
    """The writer's output on the generator's real agent-loop trajectories (calculator tool)."""
    write_run(tmp_path, "tools", steps=1)
    record = json.loads((tmp_path / "logs" / RECORDS_DIR / "train_step_1.json").read_text())
    first = record["groups"][0]
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    call_then_answer, _, no_tool, cut = first["samples"]
    roles = [(s["role"], s["tool_call"]) for s in call_then_answer["segments"]]
    assert roles == [("assistant", True), ("tool", False), ("assistant", False)]
    assert "17954" in call_then_answer["segments"][1]["text"]  # the calculator's result
    assert call_then_answer["reward"] == 1.0 and call_then_answer["num_turns"] == 2
    assert call_then_answer["metrics"]["tool_calls"] == 1.0
    assert [s["role"] for s in no_tool["segments"]] == ["assistant"]
    assert cut["stop_reason"] == "length"
    for sample in first["samples"]:
        for segment in sample["segments"]:
            if segment["role"] == "assistant":
                assert "".join(segment["tokens"]) == segment["text"]
                assert len(segment["diff"]) == len(segment["tokens"])
        assert sample["max_abs_diff"] == pytest.approx(0.2, abs=0.01)  # the fixture's mismatch


def test_an_evaluation_counts_correct_samples(tmp_path: Path) -> None:
    generator = FakeGenerator(reward=lambda row, sample, version: float(row % 2 == 0))
    run = fake_run(tmp_path, "trainer.max_steps=1", "trainer.eval_interval=1", generator=generator)
    try:
        run.trainer.fit()
    finally:
        run.close()
    record = json.loads((tmp_path / "logs" / RECORDS_DIR / "eval_step_1.json").read_text())
    for group in record["groups"]:
        assert all(s["correct"] == (s["reward"] > 0) for s in group["samples"])
