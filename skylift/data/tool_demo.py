"""The task of ``skylift demo --task tools``: products of a two-digit and a three-digit number, with a
calculator tool (the ``calculator`` environment, `skylift.envs.calculator`).

A 135M model cannot multiply 47 by 382 in its head; it can learn to ask the calculator. The prompt
is a system message that describes the tool and its call format (SmolLM2's chat template has no
``tools`` section, so the prompt teaches it), then the question. With ``worked_example`` the prompt
also holds one solved problem as conversation turns (the call, the tool's answer, ``#### n``): a
product like the task's ("product": 23 * 456) or a small sum ("sum": 2 + 3, which shows the call
but not for a product). The held-out and train sets are disjoint sets of (A, B) pairs, neither
holding the product example's pair.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from skylift.data.schema import PreparedDataset, make_row, write_prompt_parquet

TOOL_DEMO_DATA_SOURCE = "skylift/tool-demo"
TOOL_DEMO_ENV_CLASS = "calculator"
FIRST_FACTOR: tuple[int, int] = (10, 99)
SECOND_FACTOR: tuple[int, int] = (100, 999)
TOOL_DEMO_EXAMPLE_PAIR: tuple[int, int] = (23, 456)
TOOL_DEMO_NUM_HELDOUT = 100
TOOL_DEMO_SYSTEM = (
    "You have a calculator. To use it, write "
    '<tool name="calculator">{"expression": "..."}</tool> and stop; its result comes back to you. '
    "Then give the final answer after ####."
)
_EXTRA_FIELDS: tuple[tuple[str, pa.DataType], ...] = (("a", pa.int64()), ("b", pa.int64()))


def product_question(a: int, b: int) -> str:
    """``"What is A * B?"``"""
    return f"What is {a} * {b}?"


def tool_call_text(a: int, b: int) -> str:
    """The call the policy should make for A * B, in the ``xml`` tool-call format."""
    return calculator_call(f"{a} * {b}")


def calculator_call(expression: str) -> str:
    """A calculator call in the ``xml`` tool-call format."""
    return f'<tool name="calculator">{{"expression": "{expression}"}}</tool>'


#: The solved problems a prompt can show (``worked_example``): name -> (question, expression, result).
TOOL_DEMO_EXAMPLES: dict[str, tuple[str, str, int]] = {
    "product": (product_question(*TOOL_DEMO_EXAMPLE_PAIR), "23 * 456", 23 * 456),
    "sum": ("What is 2 + 3?", "2 + 3", 5),
}


def tool_demo_prompt(a: int, b: int, worked_example: str | None = None) -> list[dict[str, str]]:
    """The system message, the worked example's four turns (a name of `TOOL_DEMO_EXAMPLES`; None:
    none), the question."""
    messages = [{"role": "system", "content": TOOL_DEMO_SYSTEM}]
    if worked_example is not None:
        if worked_example not in TOOL_DEMO_EXAMPLES:
            known = ", ".join(TOOL_DEMO_EXAMPLES)
            raise ValueError(f"unknown worked example {worked_example!r}; known: {known}")
        question, expression, result = TOOL_DEMO_EXAMPLES[worked_example]
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": calculator_call(expression)},
            {"role": "tool", "content": str(result)},
            {"role": "assistant", "content": f"#### {result}"},
        ]
    return [*messages, {"role": "user", "content": product_question(a, b)}]


def tool_demo_row(
    a: int, b: int, split: str, index: int, worked_example: str | None = None
) -> dict[str, Any]:
    """The prompt-parquet row of the problem A * B."""
    return make_row(
        data_source=TOOL_DEMO_DATA_SOURCE,
        prompt=tool_demo_prompt(a, b, worked_example),
        env_class=TOOL_DEMO_ENV_CLASS,
        ground_truth=str(a * b),
        extra_info={
            "split": split,
            "index": index,
            "question": product_question(a, b),
            "answer": f"{tool_call_text(a, b)}\n#### {a * b}",
            "a": a,
            "b": b,
        },
    )


def tool_demo_pairs(
    num_train: int, num_heldout: int = TOOL_DEMO_NUM_HELDOUT, seed: int = 0
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint (train, held-out) lists of distinct (A, B) pairs, A two-digit and B three-digit,
    drawn with `seed`; the worked example's pair is never drawn."""
    size = (FIRST_FACTOR[1] - FIRST_FACTOR[0] + 1) * (SECOND_FACTOR[1] - SECOND_FACTOR[0] + 1) - 1
    if num_train < 0 or num_heldout < 0 or num_train + num_heldout > size:
        raise ValueError(
            f"num_train ({num_train}) + num_heldout ({num_heldout}) must be between 0 and {size} "
            "(the number of distinct product pairs)"
        )
    rng = random.Random(seed)
    seen = {TOOL_DEMO_EXAMPLE_PAIR}
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num_heldout + num_train:
        pair = (rng.randint(*FIRST_FACTOR), rng.randint(*SECOND_FACTOR))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs[num_heldout:], pairs[:num_heldout]


def write_tool_demo(
    out_dir: str | Path,
    num_train: int = 2000,
    num_val: int = TOOL_DEMO_NUM_HELDOUT,
    seed: int = 0,
    worked_example: str | None = None,
) -> PreparedDataset:
    """Write the tool demo's ``train.parquet`` and ``validation.parquet`` (the held-out problems)."""
    start = time.perf_counter()
    train_pairs, heldout_pairs = tool_demo_pairs(num_train, num_val, seed)
    out = Path(out_dir)
    result = PreparedDataset(out_dir=out, source=f"synthetic:tool-demo(seed={seed})")
    for split, pairs in (("train", train_pairs), ("validation", heldout_pairs)):
        rows = [tool_demo_row(a, b, split, i, worked_example) for i, (a, b) in enumerate(pairs)]
        result.files[split] = write_prompt_parquet(rows, out / f"{split}.parquet", _EXTRA_FIELDS)
        result.num_rows[split] = len(rows)
    result.seconds = time.perf_counter() - start
    return result
