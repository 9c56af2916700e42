"""SkyRL's vision-language examples' environments, ``geometry3k`` and ``visgym``
(`skylift.compat.skyrl.geometry3k`, `skylift.compat.skyrl.visgym`), and their datasets' rows."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from skylift.compat.skyrl import gym
from skylift.compat.skyrl.geometry3k import Geometry3kEnv, answer_in_text, parse_tool_call
from skylift.compat.skyrl.math_answers import last_boxed, same_answer
from skylift.compat.skyrl.visgym import VisGymEnv, keyword_action, tuple_action, well_formatted
from skylift.config import load_config
from skylift.data import PromptDataset
from skylift.envs import EnvUsageError, get_env_factory, make_env
from skylift.generator.vision import message_images

MAZE = "tests.visgym_maze:make_maze"


def _data_url(size: tuple[int, int], colour: tuple[int, int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def _call(answer: str, name: str = "calc_score") -> str:
    return f"I think so. <tool_call>{json.dumps({'name': name, 'arguments': {'answer': answer}})}</tool_call>"


@pytest.fixture(autouse=True)
def _run_settings():
    gym.configure({}, 3)
    yield
    gym.configure({}, 1)


@pytest.mark.parametrize(
    "given,truth,same",
    [
        ("\\boxed{3\\sqrt{3}}", "3 \\sqrt { 3 }", True),  # spaces as geometry3k's answers have them
        ("3\\sqrt3", "3\\sqrt{3}", True),
        ("\\frac{40}{3}", "40/3", True),
        ("\\dfrac{1}{2}", "0.5", True),
        ("\\sqrt{12}", "2\\sqrt{3}", True),  # equal as expressions
        ("60^\\circ", "60", True),
        ("x = 12", "12", True),
        ("12 cm", "12", True),
        ("1,000", "1000", True),
        ("2\\pi", "2 \\pi", True),
        ("\\frac{2}{4}", "\\frac{1}{2}", False),  # written-out fractions: the reduced form
        ("13.33", "\\frac{40}{3}", False),
        ("6.5", "6", False),
        ("7", "8", False),
        ("\\boxed{5", "5", False),  # an unclosed box is no answer
        ("", "5", False),
        ("x^99^99", "1", False),  # not handed to sympy
    ],
)
def test_answers_are_compared_as_skyrls_geometry3k_grades_them(given: str, truth: str, same: bool) -> None:
    assert same_answer(given, truth) is same


def test_last_boxed_takes_the_last_box_with_balanced_braces() -> None:
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("no box") is None


def test_tool_calls_are_parsed_in_both_spellings_and_the_last_one_counts() -> None:
    assert parse_tool_call(_call("5")) == ("calc_score", {"answer": "5"})
    nested = (
        '<tool_call>{"function": {"name": "calc_score", "arguments": "{\\"answer\\": \\"4\\"}"}}</tool_call>'
    )
    assert parse_tool_call(nested) == ("calc_score", {"answer": "4"})
    assert parse_tool_call(_call("1") + _call("2")) == ("calc_score", {"answer": "2"})
    assert parse_tool_call("<tool_call>{not json}</tool_call>") is None
    assert parse_tool_call("plain text") is None
    assert answer_in_text("so \\boxed{9}\nthanks") == "9"
    assert answer_in_text("reasoning\n\n  42  \n") == "42"


def _geometry_row(truth: str = "3\\sqrt{3}") -> dict:
    """A row as SkyRL's geometry_3k_dataset.py writes it (no data_source column)."""
    question = "Find x. <tool_call> ... Answer: \\boxed{$Answer}"
    content = [
        {"type": "image_url", "image_url": {"url": _data_url((56, 28), (200, 10, 10))}},
        {"type": "text", "text": question},
    ]
    return {
        "prompt": [{"role": "user", "content": content}],
        "env_class": "geometry3k",
        "reward_spec": {"method": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0, "problem": question, "answer": truth},
    }


def test_a_geometry3k_dataset_row_loads_with_its_image_and_ground_truth(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_geometry_row(), _geometry_row("12")]), path)
    rows = PromptDataset(path)
    assert [r.env_class for r in rows] == ["geometry3k", "geometry3k"]
    images = message_images(rows[0].prompt)
    assert [im.size for im in images] == [(56, 28)]
    env = make_env("geometry3k")
    assert isinstance(env, Geometry3kEnv)
    env.init(rows[1].prompt, rows[1].env_extras())
    assert env.ground_truth == "12" and env.max_turns == 3  # generator.max_turns, as SkyRL passes it


def _env(truth: str = "3\\sqrt{3}", **config: object) -> Geometry3kEnv:
    env = make_env("geometry3k", **config)
    assert isinstance(env, Geometry3kEnv)
    env.init([{"role": "user", "content": "q"}], {"reward_spec": {"ground_truth": truth}})
    return env


def test_geometry3k_a_right_tool_answer_ends_with_reward_one() -> None:
    env = _env()
    first = env.step(_call("5"))
    assert (first.reward, first.done) == (0.0, False)
    assert "wrong" in first.observations[0]["content"] and "last turn" not in first.observations[0]["content"]
    second = env.step(_call("3 \\sqrt{3}"))
    assert (second.reward, second.done, second.observations) == (1.0, True, [])
    assert second.metadata["env_metrics"] == {"turns": 2, "acc": 1.0}


def test_geometry3k_the_turn_before_the_last_warns_and_the_last_ends_with_zero() -> None:
    env = _env()
    env.step(_call("1"))
    warned = env.step(_call("2"))
    assert not warned.done and "last turn" in warned.observations[0]["content"]
    last = env.step(_call("4"))
    assert (last.reward, last.done, last.metadata["env_metrics"]) == (0.0, True, {"turns": 3, "acc": 0.0})


def test_geometry3k_an_answer_without_a_tool_call_is_graded_and_ends() -> None:
    right = _env().step("The sides give \\boxed{3\\sqrt{3}}")
    assert (right.reward, right.done) == (1.0, True)
    wrong = _env("12").step("reasoning...\nthe answer is 13")
    assert (wrong.reward, wrong.done, wrong.metadata["answer"]) == (0.0, True, "the answer is 13")


def test_geometry3k_another_tool_or_no_answer_gets_how_to_call() -> None:
    env = _env(max_turns=2)
    other = env.step(_call("1", name="calculator"))
    assert not other.done and "calc_score" in other.observations[0]["content"]
    empty = env.step('<tool_call>{"name": "calc_score", "arguments": {}}</tool_call>')
    assert (empty.reward, empty.done, empty.metadata["answer_missing"]) == (0.0, True, True)


def test_geometry3k_metrics_combine_as_skyrls() -> None:
    factory = get_env_factory("geometry3k")
    episodes = [{"turns": 1, "acc": 1.0}, {"turns": 3, "acc": 0.0}]
    assert factory.aggregate_metrics(episodes) == {"avg_turns": 2.0, "avg_acc": 0.5}  # type: ignore[attr-defined]


def _visgym(variant: str, seed: int | None = 5, max_turns: int = 4) -> tuple[VisGymEnv, list[dict]]:
    gym.configure({"visgym": {"simulator": MAZE, "variant": variant}}, max_turns)
    env = make_env("visgym")
    assert isinstance(env, VisGymEnv)
    extras = {"visgym_env_id": "maze_2d/easy", "seed": seed, "reward_spec": {}, "extra_info": {}}
    prompt = env.init([{"role": "user", "content": "placeholder"}], extras)
    return env, prompt


def test_visgym_instruct_replaces_the_ticket_with_the_simulators_prompt_and_image() -> None:
    env, prompt = _visgym("instruct", max_turns=5)
    assert env.sim.relaxed and env.sim.seeds == [5]  # type: ignore[attr-defined]
    text = prompt[0]["content"][0]["text"]
    assert text.startswith("Move the red square") and "<action>ACTION</action>" in text
    assert [im.size for im in message_images(prompt)] == [(84, 84)]
    moves = ["<action>right</action>", "hmm", "<action>right</action>", "<action>down</action>"]
    steps = [env.step(m) for m in moves]
    assert [s.done for s in steps] == [False, False, False, False]
    assert [s.metadata["env_feedback"] for s in steps[:2]] == [
        "Action executed. Here is the current state:",
        "parse_failure",
    ]
    assert all(len(message_images(s.observations)) == 1 for s in steps)  # a new frame every turn
    final = env.step("<action>up</action> no: <action>DOWN</action>")  # the last tag counts
    assert (final.reward, final.done, final.observations) == (1.0, True, [])
    assert final.metadata["env_metrics"] == {"step_count": 5.0, "parse_failures": 1.0}
    env.close()
    assert env.sim.closed  # type: ignore[attr-defined]


def test_visgym_sft_reward_mixes_task_and_format_and_max_turns_ends_it() -> None:
    env, _ = _visgym("sft", seed=None, max_turns=2)
    assert not env.sim.relaxed  # type: ignore[attr-defined]
    shaped = "<observation>grid</observation><justification>east</justification><action>('move', 0)</action>"
    first = env.step(shaped)
    assert (first.reward, first.done) == (0.0, False)
    last = env.step("(move, 3)")  # unquoted name; not at the goal after 2 turns
    assert last.done and last.reward == pytest.approx(0.8 * 0.0 + 0.2 * 0.5)
    assert last.metadata["env_metrics"]["format_success_rate"] == 0.5


def test_visgym_action_parsers() -> None:
    assert keyword_action("go <action> Left </action>") == "('move', 2)"
    assert keyword_action("<action>jump</action>") is None
    assert tuple_action("I pick ('mark', (0.5, 0.5)) now") == "('mark', (0.5, 0.5))"
    assert tuple_action("(stop, 'stop')") == "('stop', 'stop')"
    assert tuple_action("('move',") is None
    assert well_formatted("<observation>a</observation><justification>b</justification><action>c</action>")
    assert not well_formatted(
        "<observation> </observation><justification>b</justification><action>c</action>"
    )


def test_visgym_without_its_simulator_says_what_to_install_in_one_line() -> None:
    if importlib.util.find_spec("gymnasium") is not None:
        pytest.skip("gymnasium is installed here")  # the message is for a machine without VisGym
    gym.configure({}, 3)
    env = make_env("visgym")
    with pytest.raises(EnvUsageError, match="VisGym") as info:
        env.init([{"role": "user", "content": "x"}], {"visgym_env_id": "maze_2d/easy"})
    assert "\n" not in str(info.value)
    with pytest.raises(EnvUsageError, match="visgym_env_id"):
        make_env("visgym").init([{"role": "user", "content": "x"}], {})
    gym.configure({"visgym": {"variant": "sft2"}}, 3)
    with pytest.raises(EnvUsageError, match="variant"):
        make_env("visgym").init([{"role": "user", "content": "x"}], {"visgym_env_id": "m"})


def test_the_visgym_variant_key_loads_from_the_command_line() -> None:
    cfg = load_config(["environment.env_class=visgym", "environment.env_configs.visgym.variant=sft"])
    assert cfg.environment.env_configs == {"visgym": {"variant": "sft"}}
    assert json.loads(json.dumps(cfg.environment.env_configs))["visgym"]["variant"] == "sft"
