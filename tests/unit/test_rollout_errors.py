"""A rollout that fails on the user's input (an environment that raises or returns a reward that is
not a number, a row the chat template cannot render or that is too long, a request the engine
refuses) is marked with the prompt's uid and read as one line (`rollout_input`); a failure that is
not the user's (a bug, an engine that is gone) stays unmarked. Over the real `Generator` with a
scripted engine and tiny-qwen2's tokenizer, single-turn (batched, seeded or not) and multi-turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer

from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.chat import ChatTemplateError
from skylift.generator.rollout_errors import EnvironmentFailed, rollout_input
from skylift.inference.types import EngineRequestError, EngineUnavailableError, SamplingParams

PROMPT = [{"role": "user", "content": "Say yes."}]


class Divides(Environment):
    """A user's environment whose step has a bug."""

    def step(self, action: str) -> StepResult:
        return StepResult([], 1 / 0, True)


class Yes(Environment):
    def step(self, action: str) -> StepResult:
        return StepResult([], 1.0, True)


class BadInit(Yes):
    async def init(self, prompt: list[dict[str, Any]], extras: dict[str, Any]) -> list[dict[str, Any]]:
        raise KeyError("answer")


class WordReward(Environment):
    """Returns its reward as a word."""

    def step(self, action: str) -> StepResult:
        return StepResult([], "high", True)  # type: ignore[arg-type]


class WordMetric(Environment):
    def step(self, action: str) -> StepResult:
        return StepResult([], 1.0, True, metrics={"score": "good"})  # type: ignore[dict-item]


class PlainFloat(Environment):
    """Returns a number where a StepResult belongs."""

    def step(self, action: str) -> StepResult:
        return 1.0  # type: ignore[return-value]


class AsksTheLLM(Environment):
    """Asks the policy's engines (`self.llm`) during its step."""

    async def step(self, action: str) -> StepResult:
        await self.llm.chat([{"role": "user", "content": action}], max_tokens=2)
        return StepResult([], 1.0, True)


class NeedsKey(Yes):
    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        raise ValueError("environment.env_kwargs needs api_key")


class GroupWords(Yes):
    def finish_group(self, group: list[Environment], trajectories: list[Any]) -> Any:
        return ["best", "worst"]


class GroupMiscount(Yes):
    def finish_group(self, group: list[Environment], trajectories: list[Any]) -> Any:
        return [1.0]


ENVS = {
    "divides": Divides,
    "bad_init": BadInit,
    "word_reward": WordReward,
    "word_metric": WordMetric,
    "plain_float": PlainFloat,
    "asks_llm": AsksTheLLM,
    "yes": Yes,
    "needs_key": NeedsKey,
    "group_words": GroupWords,
    "group_miscount": GroupMiscount,
}


@pytest.fixture(autouse=True)
def _envs() -> Iterator[None]:
    for name, cls in ENVS.items():
        register_env(name)(cls)
    yield
    for name in ENVS:
        unregister_env(name)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


class Refusing(ScriptedEngine):
    """An engine that refuses every request, as vLLM (or a remote server's 4xx) does."""

    def __init__(self, error: Exception) -> None:
        super().__init__([])
        self.error = error

    async def generate(self, prompts: list[list[int]], params: SamplingParams, session_id: Any = None) -> Any:
        raise self.error


#: single-turn batched unseeded, single-turn seeded (one request per prompt), multi-turn
MODES = {
    "batched": (GeneratorSettings(), None),
    "seeded": (GeneratorSettings(), [7]),
    "multi_turn": (GeneratorSettings(max_turns=2), [7]),
}


def _fail(tokenizer: Any, env: str, mode: str, engine: Any = None, row: Row | None = None) -> BaseException:
    """What `generate` raises for one row of `env` with 2 samples in `mode`."""
    settings, seeds = MODES[mode]
    engine = engine or ScriptedEngine([Reply(tokenizer.encode("yes", add_special_tokens=False))] * 4)
    generator = Generator(engine, tokenizer, settings)
    row = row or Row(PROMPT, env, uid="train.parquet:17")
    with pytest.raises(Exception) as info:  # noqa: PT011 - each test checks the type it expects
        asyncio.run(generator.generate([row], 2, SamplingParams(max_tokens=4), seeds=seeds))
    return info.value


@pytest.mark.parametrize("mode", list(MODES))
def test_an_environment_that_raises_is_named_with_the_prompt(tokenizer: Any, mode: str) -> None:
    exc = _fail(tokenizer, "divides", mode)
    assert isinstance(exc, ZeroDivisionError)  # the user's exception, unchanged
    assert (
        rollout_input(exc)
        == "prompt train.parquet:17: Divides.step raised ZeroDivisionError: division by zero"
    )
    exc = _fail(tokenizer, "bad_init", mode)
    assert rollout_input(exc) == "prompt train.parquet:17: BadInit.init raised KeyError: 'answer'"
    exc = _fail(tokenizer, "needs_key", mode)
    assert rollout_input(exc) == (
        "prompt train.parquet:17: make_env('needs_key') raised ValueError: environment.env_kwargs needs api_key"
    )


@pytest.mark.parametrize("mode", ["seeded", "multi_turn"])
@pytest.mark.parametrize(
    ("env", "line"),
    [
        ("word_reward", "WordReward.step returned the reward 'high' (str), not a finite number"),
        ("word_metric", "WordMetric.step returned the metric 'score': 'good' (str), not a number"),
        ("plain_float", "PlainFloat.step returned float, not a StepResult"),
        ("group_words", "GroupWords.finish_group returned the reward 'best' (str), not a finite number"),
        ("group_miscount", "GroupMiscount.finish_group returned 1 rewards for 2 trajectories"),
    ],
)
def test_a_step_result_that_is_not_numbers_is_named(tokenizer: Any, mode: str, env: str, line: str) -> None:
    exc = _fail(tokenizer, env, mode)
    assert isinstance(exc, EnvironmentFailed)
    assert rollout_input(exc) == f"prompt train.parquet:17: {line}"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_request_the_engine_refuses_names_the_prompt_and_the_limit(tokenizer: Any, mode: str) -> None:
    refusal = EngineRequestError(
        "LocalVLLMEngine(engine-0): generate failed: The decoder prompt (length 40) is longer than the "
        "maximum model length of 32"
    )
    exc = _fail(tokenizer, "yes", mode, engine=Refusing(refusal))
    assert exc is refusal
    assert rollout_input(exc) == (  # a batch of one prompt (batched mode) names it alone
        "prompt train.parquet:17: the engine refused its request: LocalVLLMEngine(engine-0): generate failed: "
        "The decoder prompt (length 40) is longer than the maximum model length of 32"
    )


def test_a_refused_batch_names_its_first_prompt_and_says_it_is_one_of_several(tokenizer: Any) -> None:
    generator = Generator(
        Refusing(EngineRequestError("engine-0: generate: too many images")), tokenizer, GeneratorSettings()
    )
    rows = [Row(PROMPT, "yes", uid=f"r:{i}") for i in range(3)]
    with pytest.raises(EngineRequestError) as info:
        asyncio.run(generator.generate(rows, 1, SamplingParams(max_tokens=4)))
    assert rollout_input(info.value) == (
        "prompt r:0 or another of its batch of 3: the engine refused its request: engine-0: generate: too many images"
    )


def test_an_engine_refusing_the_environments_own_call_is_the_request_not_the_environment(
    tokenizer: Any,
) -> None:
    refusal = EngineRequestError("engine-0: generate: bad")
    engine = ScriptedEngine([Reply([5])] * 2)
    generator = Generator(engine, tokenizer, GeneratorSettings())
    generator.llm.engine = Refusing(refusal)  # the env's llm: the policy's engines
    with pytest.raises(EngineRequestError) as info:
        asyncio.run(generator.generate([Row(PROMPT, "asks_llm", uid="u1")], 1, SamplingParams(max_tokens=4)))
    assert rollout_input(info.value) == "prompt u1: the engine refused its request: engine-0: generate: bad"


@pytest.mark.parametrize("mode", list(MODES))
def test_what_is_not_the_users_input_stays_unmarked(tokenizer: Any, mode: str) -> None:
    gone = EngineUnavailableError("LocalVLLMEngine(engine-0): generate failed: the vLLM engine process died")
    assert rollout_input(_fail(tokenizer, "yes", mode, engine=Refusing(gone))) is None  # a stop, not a bug

    class Short(ScriptedEngine):  # an engine answering fewer samples than asked: a bug, not the data
        async def generate(self, prompts: Any, params: SamplingParams, session_id: Any = None) -> Any:
            return await super().generate(prompts, replace(params, n=1), session_id)

    if mode == "batched":
        exc = _fail(tokenizer, "yes", mode, engine=Short([Reply([5])]))
        assert isinstance(exc, RuntimeError) and "returned 1 samples" in str(exc)
        assert rollout_input(exc) is None


@pytest.mark.parametrize("mode", list(MODES))
def test_a_row_the_chat_template_cannot_render_is_named(mode: str) -> None:
    strict = chatml_tokenizer(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = Row([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "yes", uid="chat.jsonl:3")
    exc = _fail(strict, "yes", mode, row=row)
    assert isinstance(exc, ChatTemplateError)
    assert rollout_input(exc) == (
        "prompt chat.jsonl:3: the chat template cannot render the messages (roles ['user', 'user']): "
        "TemplateError: Conversation roles must alternate user/assistant/user/assistant/..."
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_a_prompt_past_max_prompt_length_names_both(tokenizer: Any, mode: str) -> None:
    settings = replace(MODES[mode][0], max_prompt_length=4)  # multi-turn too: its first context
    generator = Generator(ScriptedEngine([]), tokenizer, settings)
    with pytest.raises(ValueError, match="more than") as info:
        asyncio.run(
            generator.generate([Row(PROMPT, "yes", uid="u9")], 1, SamplingParams(), seeds=MODES[mode][1])
        )
    assert rollout_input(info.value) == "prompt u9 has 13 tokens, more than generator.max_prompt_length=4"


def test_vllms_refusal_of_a_generate_request_is_a_request_error() -> None:
    """What vLLM raises for a prompt past `max_model_len` (seen from `skylift train` with
    `generator.engine_init_kwargs.max_model_len=24`): the request's fault in `generate`, an engine
    error anywhere else (e.g. a weight update)."""
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError

    from skylift.inference.local import _engine_failure
    from skylift.inference.types import EngineError

    refused = VLLMValidationError(
        "This model's maximum context length is 24 tokens. However, your prompt contains 80 input tokens",
        parameter="input_tokens",
        value=80,
    )
    failure = _engine_failure("engine-0: generate failed", refused)
    assert isinstance(failure, EngineRequestError)
    assert str(failure).endswith("contains 80 input tokens (parameter=input_tokens, value=80)")
    assert isinstance(
        _engine_failure("engine-0: generate failed", ValueError("bad prompt")), EngineRequestError
    )
    other = _engine_failure("engine-0: update_weights failed", refused)
    assert isinstance(other, EngineError) and not isinstance(other, EngineRequestError)


def test_a_nan_metric_is_logged_not_a_reason_to_stop() -> None:
    from skylift.generator.rollout_errors import checked_step

    result = StepResult([], 1.0, True, metrics={"score": float("nan")})
    assert checked_step(WordMetric(), "step", result) is result
    with pytest.raises(Exception, match="returned the reward nan"):
        checked_step(WordMetric(), "step", StepResult([], float("nan"), True))
