"""Synthetic tasks: determinism, correct answers, difficulty knobs, the demo's disjoint splits, CLI."""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from skylift.data.commands import add_data_command
from skylift.data.synthetic import (
    ArithmeticConfig,
    addition_demo_pairs,
    make_addition_demo_splits,
    make_arithmetic_problem,
    make_arithmetic_splits,
    write_addition_demo,
    write_arithmetic_dataset,
)

_STEP = re.compile(r"(Add|Subtract|Multiply by|Divide by) (\d+)\.")


def _solve(question: str) -> tuple[int, list[str]]:
    """Independent solver of the question text: the answer and the operators used."""
    start = re.match(r"Start with (\d+)\.", question)
    assert start, question
    value, ops = int(start.group(1)), []
    for verb, number in _STEP.findall(question):
        x = int(number)
        if verb == "Add":
            value, op = value + x, "+"
        elif verb == "Subtract":
            value, op = value - x, "-"
        elif verb == "Multiply by":
            value, op = value * x, "*"
        else:
            assert value % x == 0, f"inexact division in {question}"
            value, op = value // x, "/"
        ops.append(op)
    return value, ops


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skylift")
    add_data_command(parser.add_subparsers(dest="command", required=True))
    return parser


def test_arithmetic_same_seed_same_rows_different_seed_different() -> None:
    a = make_arithmetic_splits(30, 10, seed=7)
    b = make_arithmetic_splits(30, 10, seed=7)
    c = make_arithmetic_splits(30, 10, seed=8)
    assert a == b
    assert [r["extra_info"]["question"] for r in a[0]] != [r["extra_info"]["question"] for r in c[0]]


def test_arithmetic_answers_are_correct() -> None:
    train, val = make_arithmetic_splits(200, 50, seed=1)
    for row in train + val:
        question = row["extra_info"]["question"]
        answer, _ = _solve(question)
        assert row["reward_spec"] == {"method": "rule", "ground_truth": str(answer)}
        assert row["env_class"] == "arithmetic"
        assert row["prompt"][0]["content"].startswith(question)
        solution = row["extra_info"]["answer"].split("\n")
        assert solution[-1] == f"#### {answer}"
        for line in solution[:-1]:  # every worked step is itself right
            left, right = line.split(" = ")
            a, op, b = left.split(" ")
            expected = {
                "+": int(a) + int(b),
                "-": int(a) - int(b),
                "*": int(a) * int(b),
                "/": int(a) // int(b),
            }[op]
            assert int(right) == expected


def test_arithmetic_splits_are_disjoint_and_indexed() -> None:
    train, val = make_arithmetic_splits(300, 60, seed=2)
    assert len(train) == 300 and len(val) == 60
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in val}
    assert len({r["extra_info"]["question"] for r in train}) == 300
    assert [r["extra_info"]["index"] for r in val] == list(range(60))
    assert {r["extra_info"]["split"] for r in val} == {"validation"}


@pytest.mark.parametrize(
    "config",
    [
        ArithmeticConfig(min_operands=3, max_operands=3, operators=("*",), max_factor=5),
        ArithmeticConfig(min_operands=2, max_operands=6, operators=("+", "-"), min_value=10, max_value=20),
        ArithmeticConfig(operators=("-",), allow_negative=True, max_operands=5),
        ArithmeticConfig(operators=("/", "+"), min_value=2, max_value=60, max_factor=6),
    ],
)
def test_arithmetic_knobs(config: ArithmeticConfig) -> None:
    rng = random.Random(0)
    saw_negative = False
    for _ in range(100):
        problem = make_arithmetic_problem(rng, config)
        answer, ops = _solve(problem.question)
        assert answer == problem.answer
        assert set(ops) <= set(config.operators)
        assert len(ops) + 1 <= config.max_operands
        if "/" not in config.operators:  # division chains may stop early; the others never do
            assert len(ops) + 1 >= config.min_operands
        if config.operators == ("*",):
            assert all(2 <= int(x) <= config.max_factor for _, x in _STEP.findall(problem.question))
        if not config.allow_negative:
            assert problem.answer >= 0
        saw_negative |= problem.answer < 0
    if config.allow_negative:
        assert saw_negative


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_operands": 1},
        {"min_operands": 4, "max_operands": 3},
        {"operators": ("^",)},
        {"operators": ()},
        {"min_value": 5, "max_value": 4},
        {"max_factor": 1},
    ],
)
def test_arithmetic_config_rejects_bad_knobs(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArithmeticConfig(**kwargs)


def test_arithmetic_too_many_for_config_is_an_error() -> None:
    tiny = ArithmeticConfig(min_operands=2, max_operands=2, min_value=1, max_value=2, operators=("+",))
    with pytest.raises(ValueError, match="distinct problems"):
        make_arithmetic_splits(10, 0, config=tiny)


def test_demo_pairs_disjoint_deterministic_and_exclude_example() -> None:
    train, heldout = addition_demo_pairs(2000, 100, seed=0)
    assert len(heldout) == 100 and len(set(heldout)) == 100
    assert len(train) == 2000 and len(set(train)) == 2000
    assert not set(train) & set(heldout)
    for pairs in (train, heldout):
        assert (23, 45) not in pairs and (45, 23) not in pairs
        assert all(0 <= a <= 99 and 0 <= b <= 99 for a, b in pairs)
    assert addition_demo_pairs(2000, 100, seed=0) == (train, heldout)
    assert addition_demo_pairs(2000, 100, seed=1)[1] != heldout
    # the held-out set does not depend on the train size; a smaller train set is a prefix
    small_train, small_heldout = addition_demo_pairs(50, 100, seed=0)
    assert small_heldout == heldout and small_train == train[:50]
    # every pair but the two excluded ones can be used
    everything_train, everything_heldout = addition_demo_pairs(10_000 - 2 - 100, 100, seed=0)
    assert len(set(everything_train) | set(everything_heldout)) == 9998
    with pytest.raises(ValueError, match="distinct addition pairs"):
        addition_demo_pairs(10_000, 100)


def test_demo_rows_prompt_and_answer() -> None:
    train, heldout = make_addition_demo_splits(30, 100, seed=0)
    for row in train + heldout:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert row["prompt"] == [
            {"role": "user", "content": "What is 23 + 45? Give the final answer after ####."},
            {"role": "assistant", "content": "23 + 45 = 68\n#### 68"},
            {"role": "user", "content": f"What is {a} + {b}? Give the final answer after ####."},
        ]
        assert row["reward_spec"]["ground_truth"] == str(a + b)
        assert row["extra_info"]["answer"] == f"{a} + {b} = {a + b}\n#### {a + b}"
        assert row["env_class"] == "arithmetic"
    assert {r["extra_info"]["split"] for r in heldout} == {"validation"}


def test_written_files_read_back(tmp_path: Path) -> None:
    demo = write_addition_demo(tmp_path / "demo", num_train=64, num_val=100, seed=5)
    assert demo.num_rows == {"train": 64, "validation": 100}
    rows = pq.read_table(demo.files["validation"]).to_pylist()
    assert rows == make_addition_demo_splits(64, 100, seed=5)[1]

    arith = write_arithmetic_dataset(tmp_path / "arith", num_train=16, num_val=4, seed=5)
    assert pq.read_table(arith.files["train"]).to_pylist() == make_arithmetic_splits(16, 4, seed=5)[0]


def test_cli_synthetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(
        ["data", "synthetic", "--task", "addition-demo", "--out", str(tmp_path / "d"), "--num-train", "40"]
    )
    assert args.func(args) == 0
    assert pq.read_metadata(tmp_path / "d" / "train.parquet").num_rows == 40
    assert pq.read_metadata(tmp_path / "d" / "validation.parquet").num_rows == 100

    args = _parser().parse_args(
        [
            "data",
            "synthetic",
            "--task",
            "arithmetic",
            "--out",
            str(tmp_path / "a"),
            "--num-train",
            "12",
            "--num-val",
            "3",
            "--seed",
            "9",
        ]
    )
    assert args.func(args) == 0
    assert (
        pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
        == make_arithmetic_splits(12, 3, seed=9)[0]
    )
    assert "validation: 3 rows" in capsys.readouterr().out

    args = _parser().parse_args(
        ["data", "synthetic", "--task", "addition-demo", "--out", str(tmp_path / "x"), "--num-train", "99999"]
    )
    assert args.func(args) == 1
    with pytest.raises(SystemExit):
        _parser().parse_args(["data", "synthetic", "--task", "poetry", "--out", str(tmp_path)])
