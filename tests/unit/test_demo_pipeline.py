"""`skylift demo --task sft-rl`'s supervised data: the worked train problems as chat rows, whose
trained tokens are exactly the worked answers, none of them a held-out problem."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from skylift.data import write_addition_demo
from skylift.data.chat import read_examples
from skylift.demo import DEMO_TASKS
from skylift.demo_pipeline import RL_MAX_GENERATE_LENGTH, worked_answer, write_sft_examples
from skylift.supervised.tokens import tokenize_example


def test_sft_rows_are_worked_train_problems_and_only_the_answer_trains(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    assert "sft-rl" in DEMO_TASKS
    write_addition_demo(tmp_path, num_train=200, num_val=20, seed=0)
    out = write_sft_examples(
        tmp_path / "train.parquet", tmp_path / "sft.jsonl", limit=30, one_digit_share=0.4
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30
    pairs = [tuple(int(x) for x in r["messages"][-2]["content"].split("?")[0].split()[2::2]) for r in rows]
    one_digit = [p for p in pairs if min(p) < 10]
    assert len(one_digit) == 12  # 40% of 30, against ~19% of all pairs
    train = [
        (int(r["extra_info"]["a"]), int(r["extra_info"]["b"]))
        for r in pq.read_table(tmp_path / "train.parquet").to_pylist()
    ]
    assert one_digit == [p for p in train if min(p) < 10][:12]  # the first ones, in the file's order
    assert [p for p in pairs if min(p) >= 10] == [p for p in train if min(p) >= 10][:18]
    plain = write_sft_examples(
        tmp_path / "train.parquet", tmp_path / "plain.jsonl", limit=30, one_digit_share=None
    )
    assert [json.loads(line)["messages"][-2] for line in plain.read_text().splitlines()] == [
        r["prompt"][-1] for r in pq.read_table(tmp_path / "train.parquet").to_pylist()[:30]
    ]
    heldout = {
        r["extra_info"]["question"] for r in pq.read_table(tmp_path / "validation.parquet").to_pylist()
    }
    assert not heldout & {r["messages"][-2]["content"] for r in rows}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    example = read_examples(str(out))[0]
    row = tokenize_example(tok, example, last_only=True)  # the demo's train_on_what
    trained = tok.decode([t for t, m in zip(row.ids, row.loss_mask, strict=True) if m])
    a, b = (int(x) for x in example.messages[-2]["content"].split("?")[0].split()[2::2])
    assert trained.startswith(f"{a} + {b}: tens ") and trained.endswith(
        f" = {a + b}\n#### {a + b}<|im_end|>\n"
    )


def test_the_grpo_stage_has_room_for_every_worked_answer_sft_teaches() -> None:
    """A GRPO rollout cut before its ``#### C`` line scores 0: the GRPO stage's rollout budget must
    hold the longest worked answer (and the end of turn) in the demo model's tokens."""
    from agentic_fakes import smollm2_tokenizer

    from skylift.data.synthetic import ADDITION_RANGE

    tok = smollm2_tokenizer()
    low, high = ADDITION_RANGE
    longest = max(
        len(tok(worked_answer(a, b))["input_ids"]) + 1
        for a in range(low, high + 1, 7)
        for b in (low, high - 1, high)
    )
    assert longest > 40  # the addition demo's own budget, for its direct answers, would cut them
    assert longest <= RL_MAX_GENERATE_LENGTH
