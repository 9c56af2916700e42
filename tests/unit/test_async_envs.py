"""Environments that wait and call out: ``async def init``/``step`` are awaited concurrently, plain
ones run in at most ``environment.max_env_workers`` threads, and an environment calls a model
through ``self.llm``: a real OpenAI-compatible HTTP server on 127.0.0.1 (started by the test) or
the policy's own engines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer
from aiohttp import web

from skylift.config import load_config
from skylift.config.errors import ConfigError
from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.envs.llm import LLMCallError, OpenAIChatClient
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.types import SamplingParams

PROMPT = [{"role": "user", "content": "Say yes."}]


class SlowAsync(Environment):
    """Async init and step that each wait 0.2 s; reward 1 for "yes"."""

    async def init(self, prompt: list[dict[str, Any]], extras: dict[str, Any]) -> list[dict[str, Any]]:
        await asyncio.sleep(0.2)
        return [{"role": "system", "content": "Be brief."}, *super().init(prompt, extras)]

    async def step(self, action: str) -> StepResult:
        self._begin_step()
        await asyncio.sleep(0.2)
        self.done = True
        return StepResult([], 1.0 if action == "yes" else 0.0, True)


class SlowSync(Environment):
    """A plain step that blocks 0.1 s and records its thread and how many ran at once."""

    lock = threading.Lock()
    running = 0
    peak = 0
    threads: set[str] = set()

    def step(self, action: str) -> StepResult:
        self._begin_step()
        with SlowSync.lock:
            SlowSync.running += 1
            SlowSync.peak = max(SlowSync.peak, SlowSync.running)
            SlowSync.threads.add(threading.current_thread().name)
        time.sleep(0.1)
        with SlowSync.lock:
            SlowSync.running -= 1
        self.done = True
        return StepResult([], 1.0, True)


class Judged(Environment):
    """Asks `self.llm` whether the answer is right; reward 1 when the judge answers "yes"."""

    async def step(self, action: str) -> StepResult:
        self._begin_step()
        verdict = await self.llm.chat(
            [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": action}],
            max_tokens=4,
            temperature=0.0,
        )
        self.done = True
        return StepResult([], 1.0 if verdict.strip() == "yes" else 0.0, True, {"verdict": verdict})


@pytest.fixture(autouse=True)
def _envs() -> Iterator[None]:
    for name, cls in (("slow_async", SlowAsync), ("slow_sync", SlowSync), ("judged", Judged)):
        register_env(name)(cls)
    yield
    for name in ("slow_async", "slow_sync", "judged"):
        unregister_env(name)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer()


def _yes(tokenizer: Any, count: int) -> list[Reply]:
    return [
        Reply(tokenizer.encode("yes", add_special_tokens=False) + [tokenizer.eos_token_id])
        for _ in range(count)
    ]


@pytest.mark.parametrize("multi_turn", [False, True])
def test_async_envs_are_awaited_concurrently(tokenizer: Any, multi_turn: bool) -> None:
    engine = ScriptedEngine(_yes(tokenizer, 8))
    settings = GeneratorSettings(max_turns=2 if multi_turn else 1)
    tick = time.perf_counter()
    trajectories = asyncio.run(
        Generator(engine, tokenizer, settings).generate([Row(PROMPT, "slow_async")], 8, SamplingParams())
    )
    elapsed = time.perf_counter() - tick
    assert [t.reward for t in trajectories] == [1.0] * 8
    assert "Be brief." in tokenizer.decode(trajectories[0].prompt_ids)  # what the async init returned
    assert elapsed < 8 * 0.4 / 2, f"{elapsed:.2f} s: async envs ran one after another"


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_envs_run_in_at_most_max_env_workers_threads(tokenizer: Any, workers: int) -> None:
    SlowSync.peak, SlowSync.threads = 0, set()
    engine = ScriptedEngine(_yes(tokenizer, 6))
    settings = GeneratorSettings(max_turns=2, env_workers=workers)
    trajectories = asyncio.run(
        Generator(engine, tokenizer, settings).generate([Row(PROMPT, "slow_sync")], 6, SamplingParams())
    )
    assert len(trajectories) == 6
    if workers == 0:
        assert SlowSync.threads == {threading.main_thread().name} and SlowSync.peak == 1
    else:
        assert SlowSync.peak == workers and all(name.startswith("env") for name in SlowSync.threads)


async def _judge_server(delay_s: float, seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """An OpenAI-compatible chat server on 127.0.0.1: "yes" when the last message says "yes"."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        await asyncio.sleep(delay_s)
        if body.get("model") == "broken":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        verdict = "yes" if body["messages"][-1]["content"] == "yes" else "no"
        choice = {"index": 0, "message": {"role": "assistant", "content": verdict}, "finish_reason": "stop"}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [choice]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


def test_an_env_calls_a_judge_over_http_without_blocking_generation(tokenizer: Any) -> None:
    seen: list[dict[str, Any]] = []
    no = tokenizer.encode("no", add_special_tokens=False) + [tokenizer.eos_token_id]
    engine = ScriptedEngine(_yes(tokenizer, 3) + [Reply(no)], delay_s=0.05)

    async def main() -> tuple[list[Any], float]:
        runner, url = await _judge_server(0.3, seen)
        try:
            settings = GeneratorSettings(max_turns=2, llm_base_url=url, llm_model="judge-1")
            generator = Generator(engine, tokenizer, settings)
            tick = time.perf_counter()
            out = await generator.generate([Row(PROMPT, "judged")], 4, SamplingParams())
            return out, time.perf_counter() - tick
        finally:
            await runner.cleanup()

    trajectories, elapsed = asyncio.run(main())
    assert sorted(t.reward for t in trajectories) == [0.0, 1.0, 1.0, 1.0]
    assert len(seen) == 4 and all(body["model"] == "judge-1" and body["max_tokens"] == 4 for body in seen)
    assert seen[0]["messages"][0] == {"role": "system", "content": "Answer yes or no."}
    assert elapsed < 4 * 0.3, f"{elapsed:.2f} s: judge calls were serialised"


def test_judge_errors_and_timeouts_are_clear(tokenizer: Any) -> None:
    async def main() -> None:
        runner, url = await _judge_server(0.5, [])
        try:
            broken = OpenAIChatClient(url, "broken")
            with pytest.raises(LLMCallError, match="HTTP 404: .*no such model"):
                await broken.chat([{"role": "user", "content": "x"}])
            await broken.close()
            slow = OpenAIChatClient(url, "judge", timeout_s=0.1)
            with pytest.raises(LLMCallError, match="TimeoutError"):
                await slow.chat([{"role": "user", "content": "x"}])
            await slow.close()
            with pytest.raises(ValueError, match="unknown sampling fields"):
                await OpenAIChatClient(url, "judge").chat([], logit_bias={})
        finally:
            await runner.cleanup()

    asyncio.run(main())
    with pytest.raises(ValueError, match="http"):
        OpenAIChatClient("127.0.0.1:8000/v1", "judge")


def test_without_a_judge_url_the_env_calls_the_policys_engines(tokenizer: Any) -> None:
    # the policy answers "yes", then, as the judge, "yes" again
    engine = ScriptedEngine(_yes(tokenizer, 2))
    settings = GeneratorSettings(max_turns=2)
    (trajectory,) = asyncio.run(
        Generator(engine, tokenizer, settings).generate([Row(PROMPT, "judged")], 1, SamplingParams())
    )
    assert trajectory.reward == 1.0 and trajectory.env_metadata == {"verdict": "yes"}
    judge_prompt = tokenizer.decode(engine.prompts[1])
    assert judge_prompt.startswith("<|im_start|>system\nAnswer yes or no.<|im_end|>")


def test_the_judge_url_is_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="environment.llm_base_url='ftp://judge' must be an http"):
        load_config(["environment.llm_base_url=ftp://judge"])
    cfg = load_config(["environment.llm_base_url=http://127.0.0.1:8000/v1", "environment.tool_timeout_s=2"])
    assert cfg.environment.tool_timeout_s == 2.0
