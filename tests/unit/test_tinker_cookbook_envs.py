"""tinker-cookbook's token-level environments (the real package) through skylift's generator, with
a scripted engine: its ArithmeticEnv (ProblemEnv) single-turn, a MessageEnv over two turns, group
rewards from an EnvGroupBuilder, and the clear errors."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer

from skylift.envs import make_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.token_turns import HistoryRewriteError
from skylift.inference.types import SamplingParams

pytest.importorskip("tinker_cookbook")

from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv  # noqa: E402
from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, Trajectory  # noqa: E402

MODULE = __name__


def arithmetic_group(row: dict[str, Any], group_size: int, tokenizer: Any) -> EnvGroupBuilder:
    """The cookbook's addition task for the row's ``extra_info`` x and y (role-colon renderer)."""
    renderer = renderers.get_renderer("role_colon", tokenizer)
    x, y = row["extra_info"]["x"], row["extra_info"]["y"]
    return ProblemGroupBuilder(env_thunk=partial(ArithmeticEnv, x, y, renderer), num_envs=group_size)


class TwoQuestions(MessageEnv):
    """Asks for a greeting, then asks again; 0.25 for the first turn, 1 for the second."""

    def __init__(self) -> None:
        self.history: list[renderers.Message] = [{"role": "user", "content": "Say hi."}]

    async def initial_observation(self) -> list[renderers.Message]:
        return list(self.history)

    async def step(self, message: renderers.Message) -> MessageStepResult:
        self.history.append(message)
        if len(self.history) == 2:
            self.history.append({"role": "user", "content": "Again."})
            return MessageStepResult(reward=0.25, episode_done=False, next_messages=list(self.history))
        return MessageStepResult(reward=1.0, episode_done=True, next_messages=list(self.history))


class MessageGroup(EnvGroupBuilder):
    def __init__(self, renderer_name: str, tokenizer: Any, size: int) -> None:
        self.renderer = renderers.get_renderer(renderer_name, tokenizer)
        self.size = size

    async def make_envs(self) -> Sequence[Env]:
        return [EnvFromMessageEnv(self.renderer, TwoQuestions()) for _ in range(self.size)]


def two_questions(
    row: dict[str, Any], group_size: int, tokenizer: Any, renderer: str = "qwen3"
) -> EnvGroupBuilder:
    return MessageGroup(renderer, tokenizer, group_size)


class ShortestWins(EnvGroupBuilder):
    """Group rewards: +1 to the trajectory with the fewest sampled tokens, and a metric."""

    def __init__(self, inner: EnvGroupBuilder) -> None:
        self.inner = inner
        self.cleaned = False

    async def make_envs(self) -> Sequence[Env]:
        return await self.inner.make_envs()

    async def compute_group_rewards(
        self, trajectory_group: list[Trajectory], env_group: Sequence[Env]
    ) -> list[tuple[float, dict[str, float | int]]]:
        lengths = [sum(len(t.ac.tokens) for t in tr.transitions) for tr in trajectory_group]
        return [(float(n == min(lengths)), {"length": n}) for n in lengths]

    async def cleanup(self) -> None:
        CLEANED.append(self)


CLEANED: list[ShortestWins] = []


def shortest_wins(row: dict[str, Any], group_size: int, tokenizer: Any) -> EnvGroupBuilder:
    return ShortestWins(arithmetic_group(row, group_size, tokenizer))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _generate(
    tokenizer: Any, env_class: str, replies: list[Reply], n: int, **settings: Any
) -> tuple[Any, Any]:
    engine = ScriptedEngine(replies)
    gen = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=32, **settings))
    row = Row(
        prompt=[{"role": "user", "content": "unused"}], env_class=env_class, extra_info={"x": 2, "y": 3}
    )
    out = asyncio.run(gen.generate([row], n, SamplingParams(max_tokens=32, stop=["###"])))
    return out, engine


def test_arithmetic_problem_env_scores_the_sampled_tokens(tokenizer: Any) -> None:
    stop = "\n\nUser:"
    replies = [
        Reply(_ids(tokenizer, " 5" + stop)),
        Reply(_ids(tokenizer, " 7" + stop)),
        Reply(_ids(tokenizer, " 5"), "length"),
    ]
    out, engine = _generate(tokenizer, f"tinker-cookbook:{MODULE}:arithmetic_group", replies, n=3)
    prompt = renderers.get_renderer("role_colon", tokenizer).build_generation_prompt(
        [{"role": "user", "content": "What is 2 + 3?"}]
    )
    assert [tr.prompt_ids for tr in out] == [prompt.to_ints()] * 3
    assert engine.prompts == [prompt.to_ints()] * 3
    # correct and well formed: 1; wrong: 0; correct without the stop sequence: 1 - format_coef
    assert [tr.reward for tr in out] == pytest.approx([1.0, 0.0, 0.9])
    assert [tr.metrics["correct"] for tr in out] == [1.0, 0.0, 1.0]
    assert [tr.response_ids for tr in out] == [r.token_ids for r in replies]
    assert all(tr.loss_mask == [1] * len(tr.response_ids) for tr in out)
    assert out[0].rollout_logprobs == [-0.5] * len(replies[0].token_ids)


def test_the_envs_stop_condition_is_added_to_the_runs(tokenizer: Any) -> None:
    seen: list[SamplingParams] = []

    class Recording(ScriptedEngine):
        async def generate(
            self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
        ) -> Any:
            seen.append(params)
            return await super().generate(prompts, params, session_id)

    engine = Recording([Reply(_ids(tokenizer, " 5"))])
    gen = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=32))
    row = Row(prompt=[], env_class=f"tinker-cookbook:{MODULE}:arithmetic_group", extra_info={"x": 2, "y": 3})
    asyncio.run(gen.generate([row], 1, SamplingParams(max_tokens=32, stop=["###"])))
    assert seen[0].stop == ["###", "\n\nUser:"]


def test_a_message_env_over_two_turns_keeps_the_sampled_ids(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first, second = _ids(tokenizer, "hi") + [eos], _ids(tokenizer, "hello") + [eos]
    out, engine = _generate(
        tokenizer, f"tinker-cookbook:{MODULE}:two_questions", [Reply(first), Reply(second)], n=1, max_turns=3
    )
    (tr,) = out
    renderer = renderers.get_renderer("qwen3", tokenizer)
    convo = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Again."},
    ]
    second_context = renderer.build_generation_prompt(convo).to_ints()
    assert engine.prompts[1] == second_context
    assert tr.prompt_ids + tr.response_ids == second_context + second
    between = len(second_context) - len(tr.prompt_ids) - len(first)
    assert tr.loss_mask == [1] * len(first) + [0] * between + [1] * len(second)
    assert tr.num_turns == 2
    assert tr.turn_rewards == [(len(first) - 1, 0.25), (len(tr.response_ids) - 1, 1.0)]
    assert tr.reward == pytest.approx(1.25)


def test_a_renderer_that_rewrites_history_is_refused(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [Reply(_ids(tokenizer, "<think>\nhm\n</think>\n\nhi") + [eos]), Reply([eos])]
    with pytest.raises(HistoryRewriteError, match="rewrote earlier tokens.*step_wise_trajectories=true"):
        _generate(tokenizer, f"tinker-cookbook:{MODULE}:two_questions", replies, n=1, max_turns=3)


def test_with_step_wise_trajectories_each_turn_is_a_sample_of_the_renderers_context(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = _ids(tokenizer, "<think>\nhm\n</think>\n\nhi") + [eos]
    second = _ids(tokenizer, "hello") + [eos]
    out, engine = _generate(
        tokenizer,
        f"tinker-cookbook:{MODULE}:two_questions",
        [Reply(first), Reply(second)],
        n=1,
        max_turns=3,
        step_wise=True,
    )
    assert [tr.response_ids for tr in out] == [first, second]
    assert [tr.prompt_ids for tr in out] == engine.prompts
    assert "hm" not in tokenizer.decode(out[1].prompt_ids)  # the renderer dropped the past thinking
    assert [tr.reward for tr in out] == [1.25, 1.25] and [tr.last_step for tr in out] == [False, True]
    assert out[0].trajectory_id == out[1].trajectory_id


def test_group_rewards_and_metrics_are_added_and_the_builder_cleaned_up(tokenizer: Any) -> None:
    replies = [Reply(_ids(tokenizer, " 5 is the answer")), Reply(_ids(tokenizer, " 5"))]
    CLEANED.clear()
    out, _ = _generate(tokenizer, f"tinker-cookbook:{MODULE}:shortest_wins", replies, n=2)
    assert [tr.reward for tr in out] == pytest.approx([0.9, 1.9])  # no stop sequence: 0.9 each
    assert [tr.metrics["group/length"] for tr in out] == [
        len(replies[0].token_ids),
        len(replies[1].token_ids),
    ]
    assert len(CLEANED) == 1


def test_a_builder_making_the_wrong_number_of_envs_is_a_clear_error(tokenizer: Any) -> None:
    module = sys.modules[MODULE]
    module.one_env = lambda row, group_size, tokenizer: arithmetic_group(row, 1, tokenizer)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="made 1 environments for a group of 2"):
        _generate(tokenizer, f"tinker-cookbook:{MODULE}:one_env", [Reply([1]), Reply([1])], n=2)


def test_bad_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="package.module:factory"):
        make_env("tinker-cookbook:no_factory")
    with pytest.raises(ValueError, match="cannot import"):
        make_env("tinker-cookbook:skylift_no_such_module:f")


def test_env_kwargs_reach_the_factory_only_when_it_names_them(tokenizer: Any) -> None:
    env = make_env(f"tinker-cookbook:{MODULE}:two_questions", renderer="role_colon", base_url="x")
    from skylift.integrations.tinker_cookbook.env import _accepted

    assert _accepted(env) == {"renderer": "role_colon"}  # type: ignore[arg-type]
