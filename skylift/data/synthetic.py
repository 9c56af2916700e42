"""Synthetic tasks in GSM8K's ``#### answer`` format, deterministic from a seed.

Two generators, both writing the prompt-parquet schema of `skylift.data.schema`:

- **arithmetic**: multi-step chains ("Start with 12. Add 7. Multiply by 3. ...") whose worked
  solution lists one operation per line and ends with ``#### <result>``; ``env_class`` "arithmetic".
  Difficulty knobs live in `ArithmeticConfig`.
- **addition demo** (``skylift demo``): A + B with A, B in [0, 99]. The prompt is a chat with one
  worked example turn (user "What is 23 + 45? ...", assistant "23 + 45 = 68\\n#### 68") followed by
  the question in the same form. The held-out set (default 100 problems) and the train set are
  disjoint sets of (A, B) pairs, and neither contains the worked example's pair (23, 45) nor its
  mirror (45, 23).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from skylift.data.gsm8k import GSM8K_INSTRUCTION
from skylift.data.schema import PreparedDataset, make_row, write_prompt_parquet

ARITHMETIC_DATA_SOURCE = "skylift/synthetic-arithmetic"
ARITHMETIC_ENV_CLASS = "arithmetic"
OPERATORS: tuple[str, ...] = ("+", "-", "*", "/")
_PHRASES = {"+": "Add {x}.", "-": "Subtract {x}.", "*": "Multiply by {x}.", "/": "Divide by {x}."}


# --------------------------------------------------------------------------- multi-step arithmetic


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the multi-step arithmetic task.

    min_operands / max_operands: numbers in a chain (>= 2; a chain with k numbers has k-1 steps).
    min_value / max_value: range of the start number and of the operands of ``+`` and ``-``.
    max_factor: operands of ``*`` and ``/`` are drawn from [2, max_factor] (divisions are exact).
    operators: the allowed operations, a subset of ``+ - * /``.
    allow_negative: when False, ``-`` never takes the running value below zero.
    A chain ends early when no allowed operator can continue it (e.g. only ``/`` and a prime).
    """

    min_operands: int = 2
    max_operands: int = 4
    min_value: int = 1
    max_value: int = 50
    max_factor: int = 9
    operators: tuple[str, ...] = ("+", "-", "*")
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}"
            )
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {self.min_value}, {self.max_value}")
        if self.max_factor < 2:
            raise ValueError(f"max_factor must be >= 2, got {self.max_factor}")
        unknown = [op for op in self.operators if op not in OPERATORS]
        if unknown or not self.operators:
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators}")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One generated problem: the question text, its worked solution and the integer answer."""

    question: str
    solution: str
    answer: int


def _next_step(rng: random.Random, value: int, cfg: ArithmeticConfig) -> tuple[str, int] | None:
    """A random feasible (operator, operand) for the running `value`, or None if there is none."""
    feasible: list[str] = []
    for op in cfg.operators:
        if op == "-" and not cfg.allow_negative and value < cfg.min_value:
            continue
        if op == "/" and not any(value % d == 0 for d in range(2, cfg.max_factor + 1)):
            continue
        feasible.append(op)
    if not feasible:
        return None
    op = rng.choice(feasible)
    if op == "+":
        return op, rng.randint(cfg.min_value, cfg.max_value)
    if op == "-":
        high = cfg.max_value if cfg.allow_negative else min(cfg.max_value, value)
        return op, rng.randint(cfg.min_value, high)
    if op == "*":
        return op, rng.randint(2, cfg.max_factor)
    return op, rng.choice([d for d in range(2, cfg.max_factor + 1) if value % d == 0])


def _apply(op: str, value: int, x: int) -> int:
    if op == "+":
        return value + x
    if op == "-":
        return value - x
    if op == "*":
        return value * x
    return value // x  # exact by construction


def make_arithmetic_problem(rng: random.Random, config: ArithmeticConfig | None = None) -> ArithmeticProblem:
    """One multi-step problem drawn from `rng` (the same rng state gives the same problem)."""
    cfg = config or ArithmeticConfig()
    num_operands = rng.randint(cfg.min_operands, cfg.max_operands)
    value = rng.randint(cfg.min_value, cfg.max_value)
    sentences = [f"Start with {value}."]
    lines: list[str] = []
    for _ in range(num_operands - 1):
        step = _next_step(rng, value, cfg)
        if step is None:
            break
        op, x = step
        result = _apply(op, value, x)
        sentences.append(_PHRASES[op].format(x=x))
        lines.append(f"{value} {op} {x} = {result}")
        value = result
    question = " ".join(sentences) + " What is the final number?"
    solution = "\n".join([*lines, f"#### {value}"])
    return ArithmeticProblem(question=question, solution=solution, answer=value)


def arithmetic_prompt(question: str) -> list[dict[str, str]]:
    """The chat prompt of an arithmetic problem (same instruction as GSM8K)."""
    return [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}]


def arithmetic_row(problem: ArithmeticProblem, split: str, index: int) -> dict[str, Any]:
    """The prompt-parquet row of one arithmetic problem."""
    return make_row(
        data_source=ARITHMETIC_DATA_SOURCE,
        prompt=arithmetic_prompt(problem.question),
        env_class=ARITHMETIC_ENV_CLASS,
        ground_truth=str(problem.answer),
        extra_info={"split": split, "index": index, "question": problem.question, "answer": problem.solution},
    )


def make_arithmetic_splits(
    num_train: int, num_val: int, seed: int = 0, config: ArithmeticConfig | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and validation rows: `num_train` + `num_val` distinct problems (by question text) from
    one seeded stream; the first `num_train` are train, the rest validation, so the two are disjoint."""
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train}, {num_val}")
    rng = random.Random(seed)
    wanted = num_train + num_val
    problems: list[ArithmeticProblem] = []
    seen: set[str] = set()
    attempts, max_attempts = 0, 50 * wanted + 1000
    while len(problems) < wanted:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"only {len(problems)} distinct problems after {max_attempts} draws; "
                f"the configuration {config} is too small for {wanted} problems"
            )
        problem = make_arithmetic_problem(rng, config)
        if problem.question not in seen:
            seen.add(problem.question)
            problems.append(problem)
    train = [arithmetic_row(p, "train", i) for i, p in enumerate(problems[:num_train])]
    val = [arithmetic_row(p, "validation", i) for i, p in enumerate(problems[num_train:])]
    return train, val


def write_arithmetic_dataset(
    out_dir: str | Path,
    num_train: int = 1000,
    num_val: int = 100,
    seed: int = 0,
    config: ArithmeticConfig | None = None,
) -> PreparedDataset:
    """Write ``train.parquet`` and ``validation.parquet`` of the multi-step arithmetic task."""
    start = time.perf_counter()
    train, val = make_arithmetic_splits(num_train, num_val, seed, config)
    return _write_splits(
        out_dir, f"synthetic:arithmetic(seed={seed})", {"train": train, "validation": val}, (), start
    )


# --------------------------------------------------------------------------- addition demo

ADDITION_DEMO_DATA_SOURCE = "skylift/addition-demo"
ADDITION_DEMO_ENV_CLASS = "arithmetic"
ADDITION_RANGE: tuple[int, int] = (0, 99)
DEMO_EXAMPLE_PAIR: tuple[int, int] = (23, 45)
#: pairs never sampled: the worked example and its mirror image
DEMO_EXCLUDED_PAIRS: frozenset[tuple[int, int]] = frozenset({(23, 45), (45, 23)})
DEMO_NUM_HELDOUT = 100
_DEMO_EXTRA_FIELDS: tuple[tuple[str, pa.DataType], ...] = (("a", pa.int64()), ("b", pa.int64()))


def addition_question(a: int, b: int) -> str:
    """``"What is A + B? Give the final answer after ####."``"""
    return f"What is {a} + {b}? Give the final answer after ####."


def addition_solution(a: int, b: int) -> str:
    """The worked answer in the demo's format: ``"A + B = C\\n#### C"``."""
    return f"{a} + {b} = {a + b}\n#### {a + b}"


def addition_demo_prompt(a: int, b: int) -> list[dict[str, str]]:
    """The demo chat: the worked example (23 + 45) as a user/assistant turn, then the question."""
    ex_a, ex_b = DEMO_EXAMPLE_PAIR
    return [
        {"role": "user", "content": addition_question(ex_a, ex_b)},
        {"role": "assistant", "content": addition_solution(ex_a, ex_b)},
        {"role": "user", "content": addition_question(a, b)},
    ]


def addition_demo_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """The prompt-parquet row of the demo problem A + B."""
    return make_row(
        data_source=ADDITION_DEMO_DATA_SOURCE,
        prompt=addition_demo_prompt(a, b),
        env_class=ADDITION_DEMO_ENV_CLASS,
        ground_truth=str(a + b),
        extra_info={
            "split": split,
            "index": index,
            "question": addition_question(a, b),
            "answer": addition_solution(a, b),
            "a": a,
            "b": b,
        },
    )


def addition_demo_pairs(
    num_train: int, num_heldout: int = DEMO_NUM_HELDOUT, seed: int = 0
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint (train, held-out) lists of distinct (A, B) pairs, A and B in [0, 99].

    All pairs except `DEMO_EXCLUDED_PAIRS` are shuffled with `seed`; the first `num_heldout` are the
    held-out set and the next `num_train` the train set. So the held-out set depends only on `seed`
    and `num_heldout`, and a smaller train set is a prefix of a larger one.
    """
    low, high = ADDITION_RANGE
    pool = [
        (a, b)
        for a in range(low, high + 1)
        for b in range(low, high + 1)
        if (a, b) not in DEMO_EXCLUDED_PAIRS
    ]
    if num_train < 0 or num_heldout < 0 or num_train + num_heldout > len(pool):
        raise ValueError(
            f"num_train ({num_train}) + num_heldout ({num_heldout}) must be between 0 and {len(pool)} "
            "(the number of distinct addition pairs)"
        )
    random.Random(seed).shuffle(pool)
    return pool[num_heldout : num_heldout + num_train], pool[:num_heldout]


def make_addition_demo_splits(
    num_train: int, num_heldout: int = DEMO_NUM_HELDOUT, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prompt rows of the demo's train set and held-out set (see `addition_demo_pairs`)."""
    train_pairs, heldout_pairs = addition_demo_pairs(num_train, num_heldout, seed)
    train = [addition_demo_row(a, b, "train", i) for i, (a, b) in enumerate(train_pairs)]
    heldout = [addition_demo_row(a, b, "validation", i) for i, (a, b) in enumerate(heldout_pairs)]
    return train, heldout


def write_addition_demo(
    out_dir: str | Path, num_train: int = 1000, num_val: int = DEMO_NUM_HELDOUT, seed: int = 0
) -> PreparedDataset:
    """Write the demo's ``train.parquet`` and ``validation.parquet`` (the held-out problems)."""
    start = time.perf_counter()
    train, heldout = make_addition_demo_splits(num_train, num_val, seed)
    return _write_splits(
        out_dir,
        f"synthetic:addition-demo(seed={seed})",
        {"train": train, "validation": heldout},
        _DEMO_EXTRA_FIELDS,
        start,
    )


def _write_splits(
    out_dir: str | Path,
    source: str,
    splits: dict[str, list[dict[str, Any]]],
    extra_fields: Sequence[tuple[str, pa.DataType]],
    start: float,
) -> PreparedDataset:
    out = Path(out_dir)
    result = PreparedDataset(out_dir=out, source=source)
    for split, rows in splits.items():
        result.files[split] = write_prompt_parquet(rows, out / f"{split}.parquet", extra_fields)
        result.num_rows[split] = len(rows)
    result.seconds = time.perf_counter() - start
    return result
