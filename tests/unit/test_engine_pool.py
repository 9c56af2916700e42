"""`EnginePool` failover with fake engines: an engine that dies in the middle of a batch has its
prompts answered by the survivor, the pool records why it left, and with no engine left the error
names every engine. (tests/reliability/test_engine_failover.py kills real `skylift serve`
processes inside a training run, which goes through the same pool.)"""

from __future__ import annotations

import asyncio

import pytest

from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import (
    Completion,
    EngineRequestError,
    EngineUnavailableError,
    GenerateOutput,
    SamplingParams,
)


class FakeEngine:
    """Answers each prompt with `n` completions of `max_tokens` copies of the prompt's first token;
    once `die()` is called, every call in flight or later fails as a killed server's would."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.dead = False
        self.prompts_seen: list[list[int]] = []

    def __repr__(self) -> str:
        return self.name

    def die(self) -> None:
        self.dead = True
        self.release.set()

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        if self.dead:
            raise EngineUnavailableError(f"{self.name}: connection refused")
        self.prompts_seen += prompts
        self.started.set()
        await self.release.wait()
        if self.dead:
            raise EngineUnavailableError(f"{self.name}: the server closed the connection mid-request")
        return [
            GenerateOutput(
                prompt_token_ids=p,
                completions=[
                    Completion(token_ids=[p[0]] * params.max_tokens, logprobs=None, stop_reason="length")
                    for _ in range(params.n)
                ],
            )
            for p in prompts
        ]


PARAMS = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=None)
PROMPTS = [[1 + i, 2, 3, 4] for i in range(8)]


def test_an_engine_killed_mid_batch_has_its_prompts_answered_by_the_other() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b])

    async def scenario() -> list[GenerateOutput]:
        a.release.clear()  # engine a holds its share until it is killed
        task = asyncio.create_task(pool.generate(PROMPTS, PARAMS))
        await asyncio.wait_for(a.started.wait(), 5)
        assert pool.router.in_flight[0] > 0
        a_share = list(a.prompts_seen)
        assert a_share and len(a_share) < len(PROMPTS)  # the batch was split over both
        a.die()
        outputs = await asyncio.wait_for(task, 5)
        assert sorted(b.prompts_seen) == sorted(PROMPTS)  # its own share, then a's again
        return outputs

    outputs = asyncio.run(scenario())
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # every prompt, in order, in full
    assert all(len(o.completions) == 4 and len(c.token_ids) == 5 for o in outputs for c in o.completions)
    assert all(c.token_ids[0] == o.prompt_token_ids[0] for o in outputs for c in o.completions)
    assert list(pool.failures) == [0] and "mid-request" in pool.failures[0]
    assert pool.live_indices == [1]
    assert pool.sequences_served == [0, len(PROMPTS) * PARAMS.n]  # all of them, retries included
    assert pool.router.in_flight == [0, 0]


def test_with_no_engine_left_the_error_names_every_engine_and_why() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b])
    a.die()
    outputs = asyncio.run(pool.generate(PROMPTS[:2], PARAMS))
    assert len(outputs) == 2 and pool.live_indices == [1]
    b.die()
    with pytest.raises(NoHealthyEngineError) as info:
        asyncio.run(pool.generate(PROMPTS[:2], PARAMS))
    message = str(info.value)
    assert "no healthy inference engine left (2 failed)" in message
    assert (
        "engine 0 (a): a: connection refused" in message and "engine 1 (b): b: connection refused" in message
    )
    with pytest.raises(NoHealthyEngineError):  # and stays so: no engine is tried again
        asyncio.run(pool.generate(PROMPTS[:1], PARAMS))


def test_a_bad_request_is_not_failover() -> None:
    """A request the engine refuses (4xx) is raised as is: the engine stays in service."""

    class Refusing(FakeEngine):
        async def generate(self, prompts, params, session_id=None):  # type: ignore[no-untyped-def]
            raise EngineRequestError("max_tokens too large")

    pool = EnginePool([Refusing("a"), FakeEngine("b")])
    with pytest.raises(EngineRequestError, match="max_tokens too large"):
        asyncio.run(pool.generate(PROMPTS, PARAMS))
    assert pool.failures == {} and pool.live_indices == [0, 1]
