"""The training-run benchmarks' step figures (`benchmarks/_runs.py`): which steps are timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _runs import step_figures  # noqa: E402


def _rows(step_times: list[float]) -> list[dict[str, float]]:
    return [
        {
            "timing/step_s": t,
            "timing/wait_s": t / 2,
            "reward/mean": i / 10,
            "async/staleness_max": float(i % 3),
        }
        for i, t in enumerate(step_times)
    ]


def test_default_times_steps_two_to_n_minus_one() -> None:
    figures = step_figures(_rows([20.0, 4.0, 6.0, 8.0, 30.0]), ("wait_s",))
    assert figures["step_s"] == pytest.approx(6.0)
    assert figures["phases"]["wait_s"] == pytest.approx(3.0)
    assert figures["step_times"] == [20.0, 4.0, 6.0, 8.0, 30.0]
    assert figures["rewards"] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert figures["staleness_max"] == 2.0


def test_warmup_leaves_more_first_steps_out() -> None:
    rows = _rows([20.0, 12.0, 6.0, 8.0, 7.0, 30.0])
    assert step_figures(rows, ("wait_s",), warmup=2)["step_s"] == pytest.approx(7.0)
    assert step_figures(rows, ("wait_s",), warmup=1)["step_s"] == pytest.approx(8.25)


def test_too_few_steps_time_them_all() -> None:
    assert step_figures(_rows([3.0, 5.0]), (), warmup=2)["step_s"] == pytest.approx(4.0)
