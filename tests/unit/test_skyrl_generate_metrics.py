"""SkyRL's ``generate/*`` token figures and ``generate/trajectory_time_*`` wall-clock figures: equal
to SkyRL's own `get_rollout_metrics` (its source, read from the skyrl 0.4.0 wheel that
scripts/setup.sh downloads), logged by training steps and, as ``eval/all/generate/*``, by
evaluations; the generators time each rollout (checked on a fake clock that only the fake engine
and environment move, so every second is known)."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer
from rl_fakes import FakeGenerator, fake_run
from skyrl_clients import _unpacked, wheel_dir

from skylift.compat.skyrl.metrics import skyrl_generate_metrics, trajectory_time_metrics
from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import GenerateOutput, SamplingParams
from skylift.rl.evaluation import evaluate

SKYRL_FUNCTIONS = ("get_rollout_metrics", "compute_turn_token_counts", "_add_time_stats")


def skyrls_rollout_metrics() -> Any:
    """SkyRL's `get_rollout_metrics`, compiled from its module's source (importing the module
    pulls in cloud storage clients this machine does not have)."""
    wheel = wheel_dir() / "skyrl-0.4.0-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip(f"{wheel} missing: run scripts/setup.sh")
    source = (_unpacked(wheel) / "skyrl" / "train" / "generators" / "utils.py").read_text()
    tree = ast.parse(source)
    wanted = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in SKYRL_FUNCTIONS
    ]
    assert len(wanted) == len(SKYRL_FUNCTIONS)
    import typing

    import numpy as np

    namespace: dict[str, Any] = {"np": np, **{name: getattr(typing, name) for name in typing.__all__}}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "skyrl_utils", "exec"), namespace)  # noqa: S102
    return namespace["get_rollout_metrics"]


def trajectory(uid: str, response: int, mask: list[int], reward: float) -> Trajectory:
    mask = mask + [0] * (response - len(mask))
    return Trajectory(uid, [1, 2], list(range(response)), mask, [0.0] * response, reward, "stop")


BATCH = [  # single- and multi-turn rows, rewards > 0, == 0 and < 0
    trajectory("a", 5, [1, 1, 1, 1, 1], 1.0),
    trajectory("a", 9, [1, 1, 0, 0, 1, 1, 1, 0, 1], 0.0),
    trajectory("b", 3, [1, 1, 1], -0.5),
    trajectory("b", 7, [0, 1, 1, 1, 0, 0, 1], 2.0),
]


def test_the_figures_are_skyrls() -> None:
    skyrl = skyrls_rollout_metrics()(
        [tr.response_ids for tr in BATCH],
        [tr.reward for tr in BATCH],
        loss_masks=[tr.loss_mask for tr in BATCH],
    )
    ours = skyrl_generate_metrics(BATCH)
    assert set(ours) == set(skyrl)
    for name, value in skyrl.items():
        assert math.isclose(ours[name], float(value), rel_tol=1e-12), name
    assert ours["generate/tokens_per_turn_max"] == 5.0 and ours["generate/avg_tokens_zero_rewards"] == 9.0


def test_no_zero_reward_rows_gives_skyrls_zero() -> None:
    batch = [tr for tr in BATCH if tr.reward != 0]
    skyrl = skyrls_rollout_metrics()([tr.response_ids for tr in batch], [tr.reward for tr in batch])
    assert (
        skyrl_generate_metrics(batch)["generate/avg_tokens_zero_rewards"]
        == skyrl["generate/avg_tokens_zero_rewards"]
        == 0.0
    )


def test_training_steps_and_evaluations_log_them(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=1")
    try:
        (step,) = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert step["generate/avg_num_tokens"] > 0 and "generate/std_assistant_tokens" in step
    metrics, _ = evaluate(["one batch of rows"], lambda rows: BATCH, batch_size=4)  # type: ignore[list-item]
    for name, value in skyrl_generate_metrics(BATCH).items():
        assert metrics[f"eval/all/{name}"] == value
    assert not any(name.startswith("eval/generate/") for name in metrics)


# ---------------------------------------------------------------- trajectory_time_*


def timed(uid: str, completion: float, llm: float, env: float, **fields: Any) -> Trajectory:
    tr = trajectory(uid, 3, [1, 1, 1], 1.0)
    tr.timing = {"completion": completion, "llm": llm, "env": env}
    return dataclasses.replace(tr, **fields)


TIMED = [  # 5 rollouts, the last one step-wise (its first step carries no time)
    timed("a", 3.0, 2.0, 0.5),
    timed("a", 7.5, 6.0, 1.0),
    timed("b", 1.25, 1.0, 0.0),
    timed("b", 10.0, 4.0, 5.0),
    dataclasses.replace(trajectory("c", 2, [1, 1], 0.0), trajectory_id="r", last_step=False),
    timed("c", 4.0, 3.0, 0.75, trajectory_id="r", last_step=True),
]


def test_the_time_figures_are_skyrls() -> None:
    ends = [tr for tr in TIMED if tr.last_step]
    skyrl = skyrls_rollout_metrics()(
        [tr.response_ids for tr in ends],
        [tr.reward for tr in ends],
        trajectory_completion_times=[tr.timing["completion"] for tr in ends],
        trajectory_time_splits={name: [tr.timing[name] for tr in ends] for name in ("llm", "env")},
    )
    skyrl_times = {name: float(value) for name, value in skyrl.items() if "trajectory_time" in name}
    ours = trajectory_time_metrics(TIMED)
    assert len(ours) == 12 and set(ours) == set(skyrl_times)  # completion, llm, env, other x 3
    for name, value in skyrl_times.items():
        assert math.isclose(ours[name], value, rel_tol=1e-12), name
    # by hand: completion [3, 7.5, 1.25, 10, 4]; other = completion - llm - env = [0.5, 0.5, 0.25, 1, 0.25]
    assert ours["generate/trajectory_time_completion_mean"] == 25.75 / 5
    assert ours["generate/trajectory_time_completion_max"] == 10.0
    assert math.isclose(ours["generate/trajectory_time_completion_p90"], 7.5 + 0.6 * 2.5)
    assert ours["generate/trajectory_time_other_max"] == 1.0
    assert ours["generate/trajectory_time_other_mean"] == 2.5 / 5
    assert {k: v for k, v in skyrl_generate_metrics(TIMED).items() if "trajectory_time" in k} == ours


def test_a_rollout_without_times_leaves_the_figures_out_as_in_skyrl() -> None:
    assert trajectory_time_metrics([*TIMED, trajectory("d", 2, [1, 1], 0.0)]) == {}
    only_completion = [dataclasses.replace(tr, timing={"completion": 2.0}) for tr in TIMED[:2]]
    assert set(trajectory_time_metrics(only_completion)) == {
        "generate/trajectory_time_completion_mean",
        "generate/trajectory_time_completion_p90",
        "generate/trajectory_time_completion_max",
    }


class FakeClock:
    """Seconds that pass only when the fakes say so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


CLOCK_STEPS = {"engine": 2.0, "init": 0.25, "step": 0.5, "close": 0.125}


class TimedEngine(ScriptedEngine):
    """A scripted engine whose every call takes `CLOCK_STEPS["engine"]` seconds of the fake clock."""

    def __init__(self, replies: list[Reply], clock: FakeClock) -> None:
        super().__init__(replies)
        self.clock = clock

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        await asyncio.sleep(0)  # let the other rollouts run meanwhile
        self.clock.now += CLOCK_STEPS["engine"]
        return await super().generate(prompts, params, session_id)


class TimedTwoTurns(Environment):
    """Two turns (the first answered "Again."); init, step and close each take their seconds."""

    clock: FakeClock

    def init(self, prompt: list[dict[str, Any]], extras: dict[str, Any]) -> list[dict[str, Any]]:
        self.clock.now += CLOCK_STEPS["init"]
        return super().init(prompt, extras)

    def step(self, action: str) -> StepResult:
        self.clock.now += CLOCK_STEPS["step"]
        turn = self._begin_step()
        if turn == 1 and self.config.get("turns", 2) > 1:
            return StepResult([{"role": "user", "content": "Again."}], 0.0, False)
        self.done = True
        return StepResult([], 1.0, True)

    def close(self) -> None:
        self.clock.now += CLOCK_STEPS["close"]


@pytest.fixture()
def clock() -> Any:
    fake = FakeClock()
    TimedTwoTurns.clock = fake
    register_env("timed_two_turns")(TimedTwoTurns)
    yield fake
    unregister_env("timed_two_turns")


def rollouts(clock: FakeClock, rows: int, n: int, **settings: Any) -> list[Trajectory]:
    tokenizer = chatml_tokenizer()
    reply = Reply(tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id])
    engine = TimedEngine([reply] * 16, clock)
    kwargs = {"max_generate_length": 16, "env_kwargs": {"turns": 2}, **settings}
    generator = Generator(engine, tokenizer, GeneratorSettings(**kwargs), clock=clock)
    batch = [
        Row(prompt=[{"role": "user", "content": "Say hi."}], env_class="timed_two_turns", uid=f"row-{i}")
        for i in range(rows)
    ]
    return asyncio.run(generator.generate(batch, n, SamplingParams(max_tokens=16)))


def test_a_multi_turn_rollout_records_its_wall_clock_split(clock: FakeClock) -> None:
    (tr,) = rollouts(clock, 1, 1, max_turns=3, batched=False)
    assert tr.num_turns == 2
    # 2 engine calls, 2 steps, then init and close in "other"
    assert tr.timing == {"completion": 2 * 2.0 + 2 * 0.5 + 0.25 + 0.125, "llm": 4.0, "env": 1.0}
    figures = trajectory_time_metrics([tr])
    assert figures["generate/trajectory_time_other_mean"] == 0.375
    assert figures["generate/trajectory_time_llm_p90"] == 4.0


def test_concurrent_rollouts_are_timed_on_the_wall_clock(clock: FakeClock) -> None:
    # two rollouts of one prompt take turns (each engine call lets the other run): a rollout's
    # seconds awaiting the engine are wall-clock seconds, so they hold what the other did meanwhile
    # (as SkyRL's); its inline env steps hold only its own
    out = rollouts(clock, 1, 2, max_turns=3, batched=False)
    elapsed = clock.now - 100.0
    assert elapsed == 2 * (4.0 + 1.0 + 0.25 + 0.125)
    for tr in out:
        assert tr.timing["env"] == 1.0
        assert tr.timing["llm"] > 4.0  # its own two calls and some of the other rollout's work
        assert tr.timing["llm"] + tr.timing["env"] + 0.375 <= tr.timing["completion"] <= elapsed
    assert sum(tr.timing["completion"] for tr in out) > elapsed  # they overlapped


def test_step_wise_rollouts_carry_their_time_on_their_last_step(clock: FakeClock) -> None:
    steps = rollouts(clock, 1, 1, max_turns=3, batched=False, step_wise=True)
    assert [(tr.last_step, bool(tr.timing)) for tr in steps] == [(False, False), (True, True)]
    figures = trajectory_time_metrics(steps)
    assert figures["generate/trajectory_time_completion_mean"] == 5.375  # one rollout, counted once


def test_batched_single_turn_rollouts_share_the_engine_call(clock: FakeClock) -> None:
    out = rollouts(clock, 2, 2, env_kwargs={"turns": 1})  # 2 prompts x 2 samples, one engine call
    inits = 4 * 0.25
    # scored one after the other (inline env steps): each ends after its own step and close
    assert [tr.timing for tr in out] == [
        {"completion": inits + 2.0 + k * (0.5 + 0.125), "llm": 2.0, "env": 0.5} for k in (1, 2, 3, 4)
    ]


class TimedFake(FakeGenerator):
    """The fake generator's rollouts, the k-th of each call with k + 1 seconds (half of them the
    engine's, a quarter the environment's)."""

    async def generate(
        self, rows: Any, n: int, params: Any, policy_version: int = 0, seeds: Any = None
    ) -> Any:
        out = await super().generate(rows, n, params, policy_version, seeds)
        for k, tr in enumerate(out):
            tr.timing = {"completion": k + 1.0, "llm": (k + 1.0) / 2, "env": (k + 1.0) / 4}
        return out


def test_training_steps_and_evaluations_log_the_times(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=1", "trainer.eval_before_train=true", generator=TimedFake())
    try:
        history = run.trainer.fit()
    finally:
        run.close()
    (step,) = [h for h in history if "timing/step_s" in h]
    (evaluation,) = [h for h in history if "eval/all/avg_score" in h]
    # a step: 4 prompts x 2 samples, times 1..8 s
    assert step["generate/trajectory_time_completion_mean"] == 4.5
    assert step["generate/trajectory_time_completion_max"] == 8.0
    assert step["generate/trajectory_time_llm_mean"] == 2.25
    assert step["generate/trajectory_time_other_mean"] == 4.5 / 4
    assert math.isclose(step["generate/trajectory_time_completion_p90"], 7.3)
    assert evaluation["eval/all/generate/trajectory_time_completion_max"] > 0
    assert evaluation["eval/all/generate/trajectory_time_env_mean"] == pytest.approx(
        evaluation["eval/all/generate/trajectory_time_completion_mean"] / 4
    )
