"""OpenEnv environments through skylift's generator: the real ``openenv-core`` client against an
OpenEnv server (``tests/openenv_game.py``) on 127.0.0.1, with a scripted engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer

from skylift.envs import make_env
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.types import SamplingParams

pytest.importorskip("openenv.core")

from openenv_game import serve  # noqa: E402


@pytest.fixture(scope="module")
def game_url() -> Iterator[str]:
    url, stop = serve()
    yield url
    stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


def _reply(tokenizer: Any, text: str) -> Reply:
    return Reply(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])


def _run(tokenizer: Any, url: str, rows: list[Row], texts: list[str], n: int = 1, **kwargs: Any) -> list[Any]:
    engine = ScriptedEngine([_reply(tokenizer, t) for t in texts])
    settings = GeneratorSettings(max_generate_length=16, max_turns=3, env_kwargs={"base_url": url, **kwargs})
    return asyncio.run(
        Generator(engine, tokenizer, settings).generate(rows, n, SamplingParams(max_tokens=16))
    )


def test_a_game_over_turns_with_the_servers_rewards_and_hints(tokenizer: Any, game_url: str) -> None:
    row = Row(prompt=[], env_class="openenv", extra_info={"openenv_reset": {"target": 5}})
    (tr,) = _run(tokenizer, game_url, [row], ["3", "6", "5"])
    assert tr.num_turns == 3
    assert tr.reward == 1.0
    assert [r for _, r in tr.turn_rewards] == [0.0, 0.0, 1.0]
    text = tokenizer.decode(tr.prompt_ids + tr.response_ids)
    assert "Guess my number between 1 and 9." in tokenizer.decode(tr.prompt_ids)  # the reset observation
    assert "Wrong. Higher." in text and "Wrong. Lower." in text
    assert tr.env_metadata["observation"]["message"] == "Right."


def test_concurrent_sessions_are_separate(tokenizer: Any, game_url: str) -> None:
    rows = [
        Row(
            prompt=[{"role": "user", "content": "Guess."}],
            env_class="openenv",
            uid=f"r{t}",
            extra_info={"openenv_reset": {"target": t}},
        )
        for t in (1, 2)
    ]
    out = _run(tokenizer, game_url, rows, ["1"] * 8, n=2, action_defaults={"hint": False})
    assert [tr.reward for tr in out[:2]] == [1.0, 1.0]  # target 1: right at once
    assert [tr.num_turns for tr in out[:2]] == [1, 1]
    assert [tr.num_turns for tr in out[2:]] == [3, 3]  # target 2: three wrong guesses end it
    assert [tr.reward for tr in out[2:]] == [0.0, 0.0]
    assert "Higher" not in tokenizer.decode(out[2].response_ids)  # action_defaults reached the server
    assert tokenizer.decode(out[0].prompt_ids).count("Guess.") == 1  # a prompt: the reset text is not added


def test_bad_options_and_an_unreachable_server_are_clear_errors(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="base_url"):
        make_env("openenv")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['actoin_field'\]"):
        make_env("openenv", base_url="http://127.0.0.1:9", actoin_field="x")
    with pytest.raises(ConnectionError, match="Failed to connect"):
        _run(
            tokenizer,
            "http://127.0.0.1:9",
            [Row(prompt=[], env_class="openenv")],
            ["1"],
            connect_timeout_s=2.0,
        )
