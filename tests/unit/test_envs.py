"""Environments: the answer rule, the built-ins (single and multi-turn) and the registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skylift.data.synthetic import make_addition_demo_splits, make_arithmetic_splits
from skylift.envs import (
    RETRY_FEEDBACK,
    Environment,
    EnvUsageError,
    StepResult,
    UnknownEnvironmentError,
    extract_final_answer,
    gsm8k_reward,
    list_envs,
    make_env,
    parse_final_answer,
    register_env,
    unregister_env,
)

PROMPT = [{"role": "user", "content": "What is 70 + 2?"}]


def _extras(ground_truth: str) -> dict:
    return {"reward_spec": {"method": "rule", "ground_truth": ground_truth}, "extra_info": {}}


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("So the total is 72.\n#### 72", "72"),
        ("#### 10 wait, I made a mistake\n#### 12", "12"),  # the last one wins
        ("#### 1,234,567", "1234567"),
        ("#### $45", "45"),
        ("#### -$3", "-3"),
        ("#### -17", "-17"),
        ("#### 3.75", "3.75"),
        ("#### .5", ".5"),
        ("####   42   \n", "42"),
        ("####42", "42"),
        ("#### 72.", "72"),  # the sentence's full stop is not part of the number
        ("#### 9\n#### abc", "9"),  # a marker without a number does not count
        ("The answer is 72.", None),
        ("#### abc", None),
        ("", None),
    ],
)
def test_extract_final_answer(response: str, expected: str | None) -> None:
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    ("response", "ground_truth", "reward"),
    [
        ("#### 72", "72", 1.0),
        ("#### 71", "72", 0.0),
        ("#### 72\n#### 71", "72", 0.0),  # last #### wins
        ("#### 71\n#### 72", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $1,000", "1,000", 1.0),  # , and $ removed on both sides
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 0.5", ".50", 1.0),  # compared as decimals
        ("#### 72.0", "72", 1.0),
        ("#### 72.5", "72", 0.0),
        ("  #### 72  ", " 72 ", 1.0),
        ("72", "72", 0.0),  # no #### -> 0 even when the number is right
        ("The answer: 72", "72", 0.0),
        ("#### seventy-two", "72", 0.0),
    ],
)
def test_gsm8k_reward(response: str, ground_truth: str, reward: float) -> None:
    assert gsm8k_reward(response, ground_truth) == reward


def test_parse_reports_marker_without_number() -> None:
    parsed = parse_final_answer("#### abc")
    assert parsed.found_marker and parsed.answer is None
    assert not parse_final_answer("no marker").found_marker


def test_gsm8k_env_single_turn() -> None:
    env = make_env("gsm8k")
    assert env.init(PROMPT, _extras("72")) == PROMPT
    result = env.step("70 + 2 = 72\n#### 72")
    assert isinstance(result, StepResult)
    assert (result.reward, result.done, result.observations) == (1.0, True, [])
    assert result.metadata == {
        "found_marker": True,
        "parsed_answer": "72",
        "ground_truth": "72",
        "correct": True,
    }
    with pytest.raises(EnvUsageError, match="after the trajectory was done"):
        env.step("#### 72")
    env.close()

    env = make_env("gsm8k")
    env.init(PROMPT, _extras("72"))
    result = env.step("I think it is 72")
    assert result.reward == 0.0 and result.done
    assert result.metadata["found_marker"] is False and result.metadata["parsed_answer"] is None


def test_env_without_ground_truth_is_an_error() -> None:
    with pytest.raises(EnvUsageError, match="ground_truth"):
        make_env("arithmetic").init(PROMPT, {"extra_info": {}})


def test_env_init_does_not_alias_prompt() -> None:
    env = make_env("arithmetic")
    out = env.init(PROMPT, _extras("72"))
    out[0]["content"] = "changed"
    assert PROMPT[0]["content"] == "What is 70 + 2?"


def test_multiturn_retry_then_right() -> None:
    env = make_env("arithmetic_multiturn")
    env.init(PROMPT, _extras("72"))
    first = env.step("#### 71")
    assert (first.reward, first.done) == (0.0, False)
    assert first.observations == [{"role": "user", "content": RETRY_FEEDBACK}]
    assert first.metadata["turn"] == 1 and first.metadata["parsed_answer"] == "71"
    second = env.step("Sorry.\n#### 72")
    assert (second.reward, second.done, second.observations) == (1.0, True, [])
    assert second.metadata["turn"] == 2


def test_multiturn_right_first_and_wrong_twice() -> None:
    env = make_env("arithmetic_multiturn")
    env.init(PROMPT, _extras("72"))
    assert env.step("#### 72").done

    env = make_env("arithmetic_multiturn", max_turns=3)
    env.init(PROMPT, _extras("72"))
    results = [env.step("#### 1") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0]
    with pytest.raises(EnvUsageError):
        env.step("#### 72")
    with pytest.raises(ValueError, match="max_turns"):
        make_env("arithmetic_multiturn", max_turns=0)


@pytest.mark.parametrize("env_class", ["gsm8k", "arithmetic", "arithmetic_multiturn"])
def test_synthetic_worked_answers_score_one(env_class: str) -> None:
    train, val = make_addition_demo_splits(20, 10, seed=3)
    arith_train, _ = make_arithmetic_splits(20, 0, seed=3)
    for row in train + val + arith_train:
        env = make_env(env_class)
        env.init(row["prompt"], {"reward_spec": row["reward_spec"], "extra_info": row["extra_info"]})
        assert env.step(row["extra_info"]["answer"]).reward == 1.0
        wrong = make_env(env_class)
        wrong.init(row["prompt"], {"reward_spec": row["reward_spec"]})
        assert wrong.step(f"#### {int(row['reward_spec']['ground_truth']) + 1}").reward == 0.0


@pytest.fixture
def clean_registry() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        unregister_env(name)


def test_registry_lists_builtins_and_rejects_unknown() -> None:
    assert {"gsm8k", "arithmetic", "arithmetic_multiturn"} <= set(list_envs())
    with pytest.raises(UnknownEnvironmentError, match=r"'nope'.*arithmetic, arithmetic_multiturn.*gsm8k"):
        make_env("nope")


def test_user_registered_env(clean_registry: list[str]) -> None:
    clean_registry.append("test_echo_length")

    @register_env("test_echo_length")
    class EchoLength(Environment):
        """Reward = response length / scale."""

        def __init__(self, scale: float = 1.0, **config: object) -> None:
            super().__init__(**config)
            self.scale = scale

        def step(self, action: str) -> StepResult:
            self._begin_step()
            self.done = True
            return StepResult([], len(action) / self.scale, True, {"length": len(action)})

    assert "test_echo_length" in list_envs()
    env = make_env("test_echo_length", scale=2.0)
    assert isinstance(env, EchoLength)
    env.init(PROMPT, {})
    assert env.step("abcd").reward == 2.0

    with pytest.raises(ValueError, match="already registered"):
        register_env("test_echo_length")(type("Other", (EchoLength,), {}))
    register_env("test_echo_length", override=True)(type("Other", (EchoLength,), {}))
    assert type(make_env("test_echo_length")).__name__ == "Other"


def test_register_factory_and_bad_registrations(clean_registry: list[str]) -> None:
    clean_registry.extend(["test_factory", "test_bad_factory"])
    register_env("test_factory")(lambda **cfg: make_env("gsm8k", **cfg))
    assert type(make_env("test_factory")).__name__ == "GSM8KEnv"

    register_env("test_bad_factory")(lambda **cfg: object())
    with pytest.raises(TypeError, match="not an Environment"):
        make_env("test_bad_factory")
    with pytest.raises(TypeError, match="must subclass"):
        register_env("test_not_env")(dict)
    with pytest.raises(ValueError, match="non-empty"):
        register_env("")
