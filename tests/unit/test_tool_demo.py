"""The pieces of `skylift demo --task tools`: the calculator tool, the ``calculator`` environment
(through the generator's agent loop with a scripted engine), its reward shaping and metrics, the
task's prompts and splits, and the evaluation figures the demo's table reads."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer, smollm2_tokenizer

from skylift.data import load_prompt_file
from skylift.data.tool_demo import (
    TOOL_DEMO_EXAMPLE_PAIR,
    TOOL_DEMO_SYSTEM,
    tool_call_text,
    tool_demo_pairs,
    tool_demo_prompt,
    tool_demo_row,
    write_tool_demo,
)
from skylift.envs import list_envs, make_env
from skylift.envs.calculator import MAX_EXPRESSION_CHARS, CalculatorError, calculator, evaluate_expression
from skylift.generator import Generator, GeneratorSettings, Trajectory
from skylift.generator.chat import ChatFormat
from skylift.inference.types import SamplingParams
from skylift.rl.evaluation import evaluate


def test_the_calculator_reads_plain_arithmetic_only() -> None:
    assert calculator("47 * 382") == "17954"
    assert calculator("47 x 382") == calculator("47×382") == "17954"
    assert calculator("(1 + 2) * -3 / 2") == "-4.5"
    assert calculator("1,000 + 1") == "1001"
    assert calculator("10 / 4") == "2.5" and calculator("10 / 5") == "2"
    for bad in ("__import__('os')", "2 ** 100000", "abs(-3)", "47 *", "'a' * 3", "True + 1"):
        with pytest.raises(CalculatorError):
            evaluate_expression(bad)
    with pytest.raises(CalculatorError, match="longer than"):
        evaluate_expression("1+" * MAX_EXPRESSION_CHARS + "1")
    with pytest.raises(ZeroDivisionError):
        evaluate_expression("1 / 0")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [tokenizer.eos_token_id]


_TOKENIZER: list[Any] = []


def _tokenizer() -> Any:
    """tiny-qwen2's (ChatML) tokenizer, built once for the module."""
    if not _TOKENIZER:
        _TOKENIZER.append(chatml_tokenizer())
    return _TOKENIZER[0]


def _rollout(
    turns: list[str],
    env_kwargs: dict[str, Any] | None = None,
    a: int = 47,
    b: int = 382,
    tokenizer: Any = None,
) -> Any:
    tokenizer = tokenizer or _tokenizer()
    row_dict = tool_demo_row(a, b, "train", 0)
    row = Row(row_dict["prompt"], row_dict["env_class"], reward_spec=row_dict["reward_spec"])
    engine = ScriptedEngine([Reply(_ids(tokenizer, text)) for text in turns])
    settings = GeneratorSettings(max_turns=3, max_prompt_length=512, env_kwargs=env_kwargs)
    generator = Generator(engine, tokenizer, settings)
    (trajectory,) = asyncio.run(generator.generate([row], 1, SamplingParams(max_tokens=64)))
    return trajectory, tokenizer, row


@pytest.mark.parametrize("template", ["chatml", "smollm2"])
def test_a_call_then_the_answer_scores_and_the_ids_are_the_templates(template: str) -> None:
    """The demo's model (SmolLM2: no tools section, a `tool` role turn) and ChatML."""
    assert "calculator" in list_envs()
    turns = [tool_call_text(47, 382), "#### 17954"]
    tokenizer = smollm2_tokenizer() if template == "smollm2" else _tokenizer()
    trajectory, tokenizer, row = _rollout(turns, tokenizer=tokenizer)
    assert trajectory.reward == 1.0 and trajectory.num_turns == 2
    assert trajectory.metrics == {
        "tool_calls": 1.0,
        "tool_parse_failures": 0.0,
        "tool_errors": 0.0,
        "tool_time_s": pytest.approx(trajectory.metrics["tool_time_s"]),
        "used_tool": 1.0,
        "correct": 1.0,
    }
    conversation = [
        *row.prompt,
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "name": "calculator", "content": "17954"},
        {"role": "assistant", "content": turns[1]},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    close = ChatFormat(tokenizer).turn_close_ids()
    assert trajectory.prompt_ids + trajectory.response_ids + close[1:] == list(rendered)
    assert "<|im_start|>tool\n17954<|im_end|>" in tokenizer.decode(trajectory.response_ids)


def test_an_answer_without_the_tool_is_scored_and_counts_no_call() -> None:
    trajectory, _, _ = _rollout(["#### 17954"])
    assert trajectory.reward == 1.0 and trajectory.num_turns == 1
    assert "used_tool" not in trajectory.metrics and trajectory.metrics["correct"] == 1.0
    trajectory, _, _ = _rollout(["#### 18000"])
    assert trajectory.reward == 0.0 and trajectory.metrics["correct"] == 0.0


def test_call_reward_shapes_a_clean_call_once_and_not_a_broken_one() -> None:
    shaped = {"call_reward": 0.2}
    call = tool_call_text(47, 382)
    trajectory, _, _ = _rollout([call, call, "#### 17000"], shaped)  # two clean calls, a wrong answer
    assert trajectory.reward == pytest.approx(0.2) and trajectory.metrics["correct"] == 0.0
    assert trajectory.metrics["used_tool"] == 1.0 and trajectory.metrics["tool_calls"] == 2.0
    trajectory, _, _ = _rollout([call, "#### 17954"], shaped)
    assert trajectory.reward == pytest.approx(1.2) and trajectory.metrics["correct"] == 1.0
    broken = '<tool name="calculator">{"expression": 47 * 382}</tool>'  # not JSON
    trajectory, _, _ = _rollout([broken, '<tool name="calculator">{"expr": "1"}</tool>', "#### 1"], shaped)
    assert trajectory.reward == 0.0 and trajectory.metrics["used_tool"] == 1.0
    assert trajectory.metrics["tool_parse_failures"] == 1.0 and trajectory.metrics["tool_errors"] == 1.0
    assert make_env("calculator").call_reward == 0.0  # no shaping unless asked


def test_the_task_splits_are_disjoint_seeded_and_in_range(tmp_path: Path) -> None:
    train, heldout = tool_demo_pairs(500, 100, seed=0)
    assert len(set(train)) == 500 and len(set(heldout)) == 100 and not set(train) & set(heldout)
    assert TOOL_DEMO_EXAMPLE_PAIR not in set(train) | set(heldout)
    assert all(10 <= a <= 99 and 100 <= b <= 999 for a, b in train + heldout)
    assert tool_demo_pairs(500, 100, seed=0) == (train, heldout)
    assert tool_demo_pairs(500, 100, seed=1)[1] != heldout
    with pytest.raises(ValueError, match="distinct product pairs"):
        tool_demo_pairs(90 * 900, 100)

    plain = tool_demo_prompt(47, 382)
    assert plain == [
        {"role": "system", "content": TOOL_DEMO_SYSTEM},
        {"role": "user", "content": "What is 47 * 382?"},
    ]
    shown = tool_demo_prompt(47, 382, worked_example="product")
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert shown[3]["content"] == "10488" and shown[4]["content"] == "#### 10488"
    assert shown[2]["content"] == '<tool name="calculator">{"expression": "23 * 456"}</tool>'
    small = tool_demo_prompt(47, 382, worked_example="sum")
    assert [m["content"] for m in small[1:5]] == [
        "What is 2 + 3?",
        '<tool name="calculator">{"expression": "2 + 3"}</tool>',
        "5",
        "#### 5",
    ]
    assert small[-1] == {"role": "user", "content": "What is 47 * 382?"}
    with pytest.raises(ValueError, match="unknown worked example 'division'; known: product, sum"):
        tool_demo_prompt(47, 382, worked_example="division")

    prepared = write_tool_demo(tmp_path, num_train=20, num_val=5, worked_example="product")
    assert prepared.num_rows == {"train": 20, "validation": 5}
    rows = load_prompt_file(prepared.files["validation"])
    assert [r.prompt[3]["role"] for r in rows] == ["tool"] * 5
    a, b = heldout[0]
    assert rows[0].env_class == "calculator" and rows[0].reward_spec["ground_truth"] == str(a * b)


def _trajectory(uid: str, reward: float, metrics: dict[str, float]) -> Trajectory:
    return Trajectory(
        uid=uid,
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        rollout_logprobs=[0.0],
        reward=reward,
        stop_reason="stop",
        metrics=metrics,
    )


def test_evaluation_reports_the_environments_metrics_and_the_demo_reads_them() -> None:
    from skylift.demo import accuracy_cell, rate_cell

    trajectories = [
        _trajectory("a", 1.2, {"used_tool": 1.0, "correct": 1.0}),
        _trajectory("b", 0.2, {"used_tool": 1.0, "correct": 0.0}),
        _trajectory("c", 0.0, {"correct": 0.0}),
        _trajectory("d", 0.0, {"correct": 0.0}),
    ]
    metrics, _ = evaluate(list("abcd"), lambda rows: [t for t in trajectories if t.uid in rows], 4)
    assert metrics["eval/env/used_tool"] == 0.5 and metrics["eval/env/correct"] == 0.25
    assert metrics["eval/accuracy"] == pytest.approx(0.35)  # the shaped reward
    assert accuracy_cell(metrics).startswith("25% ± 4.3")  # right answers, not the shaped reward
    assert rate_cell(metrics) == "50%" and rate_cell({}) == "0%"
    assert accuracy_cell({"eval/accuracy": 0.7, "eval/accuracy_stderr": 0.046}) == "70% ± 4.6"
