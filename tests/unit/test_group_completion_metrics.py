"""SkyRL's fully async group figures (``generate/group_completion_time_*``,
``generate/intra_group_completion_time_*``): equal to SkyRL's own `get_group_completion_metrics` and
`get_intra_group_completion_time_std_cv` (compiled from the skyrl 0.4.0 wheel that scripts/setup.sh
downloads), and logged by fully async steps over fake parts with the seconds of a fake clock."""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rl_fakes import FakeGenerator, FakeRun, fake_run
from skyrl_clients import _unpacked, wheel_dir

from skylift.compat.skyrl.metrics import group_completion_metrics, intra_group_completion_spread
from skylift.generator.metrics import TimedGroup
from skylift.generator.trajectory import Trajectory


def _skyrl_functions(path: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Functions (and methods, as plain functions) of a SkyRL module, compiled from its source:
    importing the module pulls in Ray and cloud storage clients this test does not need."""
    wheel = wheel_dir() / "skyrl-0.4.0-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip(f"{wheel} missing: run scripts/setup.sh")
    tree = ast.parse((_unpacked(wheel) / "skyrl" / "train" / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found.append(node)
            node.decorator_list = []  # a staticmethod becomes a plain function
    assert sorted(n.name for n in found) == sorted(names)
    import typing

    namespace: dict[str, Any] = {"np": np, "GeneratorOutput": dict}
    namespace.update({name: getattr(typing, name) for name in typing.__all__})
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


@pytest.fixture(scope="module")
def skyrl() -> dict[str, Any]:
    return _skyrl_functions(
        "utils/trainer_utils.py", ("get_intra_group_completion_time_std_cv", "get_group_completion_metrics")
    )


def sample(uid: str, completion: float | None, **fields: Any) -> Trajectory:
    tr = Trajectory(uid, [1, 2], [3, 4], [1, 1], [0.0, 0.0], 1.0, "stop", **fields)
    if completion is not None:
        tr.timing = {"completion": completion, "llm": completion / 2, "env": 0.0}
    return tr


def steps(uid: str, rollout: str, count: int, completion: float) -> list[Trajectory]:
    """A step-wise rollout of `count` steps; its last one carries the rollout's time."""
    return [
        sample(uid, completion if k == count - 1 else None, trajectory_id=rollout, last_step=k == count - 1)
        for k in range(count)
    ]


GROUPS: list[TimedGroup] = [
    ([sample("a", 3.0), sample("a", 7.5), sample("a", 1.25), sample("a", 10.0)], 10.5),
    ([*steps("b", "b0", 2, 4.0), *steps("b", "b1", 1, 6.0)], 6.25),  # step-wise, 2 rollouts
    ([sample("c", 2.0)], 2.5),  # one sample: no spread
    (steps("d", "d0", 3, 5.0), 5.5),  # one step-wise rollout: SkyRL counts its 3 steps (spread 0)
    ([sample("e", 1.0), sample("e", None)], None),  # a rollout without time; the group unmeasured
    ([sample("f", 0.0), sample("f", 0.0)], 0.0),  # mean 0: a std, no coefficient of variation
]


def skyrl_output(group: Sequence[Trajectory]) -> dict[str, Any]:
    """The group as SkyRL's generator returns it: every step of a step-wise rollout repeats the
    rollout's time; no times at all when a rollout did not record one."""
    step_wise = any(tr.trajectory_id is not None for tr in group)
    ends = {tr.trajectory_id: tr.timing.get("completion") for tr in group if tr.last_step}
    times = [ends[tr.trajectory_id] if step_wise else tr.timing.get("completion") for tr in group]
    return {
        "response_ids": [tr.response_ids for tr in group],
        "trajectory_generation_times": None if None in times else times,
        "is_last_step": [tr.last_step for tr in group] if step_wise else None,
    }


def skyrls_figures(skyrl: dict[str, Any], groups: list[TimedGroup]) -> dict[str, Any]:
    """What SkyRL's fully async trainer logs of a step's groups (its
    `convert_generation_group_mini_batch_to_training_input`, step by step, no group dropped)."""
    times = [seconds for _, seconds in groups if seconds is not None]
    spreads = [skyrl["get_intra_group_completion_time_std_cv"](skyrl_output(g)) for g, _ in groups]
    stds, cvs = [s for s, _ in spreads if s is not None], [c for _, c in spreads if c is not None]
    return skyrl["get_group_completion_metrics"](times, stds, cvs)


def assert_same(ours: dict[str, float], theirs: dict[str, Any]) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert math.isclose(ours[name], float(value), rel_tol=1e-12, abs_tol=1e-15), name


@pytest.mark.parametrize("index", range(len(GROUPS)))
def test_the_intra_group_spread_is_skyrls(skyrl: dict[str, Any], index: int) -> None:
    group, _ = GROUPS[index]
    ours = intra_group_completion_spread(group)
    theirs = skyrl["get_intra_group_completion_time_std_cv"](skyrl_output(group))
    assert [x is None for x in ours] == [x is None for x in theirs]
    for a, b in zip(ours, theirs, strict=True):
        if a is not None:
            assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def test_the_spread_by_hand() -> None:
    assert intra_group_completion_spread(GROUPS[0][0]) == pytest.approx(
        (float(np.std([3.0, 7.5, 1.25, 10.0])), float(np.std([3.0, 7.5, 1.25, 10.0])) / 5.4375)
    )
    assert intra_group_completion_spread(GROUPS[1][0]) == pytest.approx((1.0, 0.2))  # last steps 4, 6
    assert intra_group_completion_spread(GROUPS[2][0]) == (None, None)
    assert intra_group_completion_spread(GROUPS[3][0]) == (0.0, 0.0)
    assert intra_group_completion_spread(GROUPS[4][0]) == (None, None)
    assert intra_group_completion_spread(GROUPS[5][0]) == (0.0, None)


@pytest.mark.parametrize("chosen", [range(6), [0], [2], [4], [2, 4], [1, 3, 5], []])
def test_the_group_figures_are_skyrls(skyrl: dict[str, Any], chosen: Sequence[int]) -> None:
    groups = [GROUPS[i] for i in chosen]
    assert_same(group_completion_metrics(groups), skyrls_figures(skyrl, groups))


def test_the_group_figures_by_hand() -> None:
    figures = group_completion_metrics(GROUPS)
    # measured groups: 10.5, 6.25, 2.5, 5.5, 0.0; p90 between 6.25 and 10.5, 0.6 of the way
    assert figures["generate/group_completion_time_mean"] == 24.75 / 5
    assert figures["generate/group_completion_time_max"] == 10.5
    assert math.isclose(figures["generate/group_completion_time_p90"], 6.25 + 0.6 * 4.25)
    stds = [float(np.std([3.0, 7.5, 1.25, 10.0])), 1.0, 0.0, 0.0]  # groups a, b, d, f
    assert math.isclose(figures["generate/intra_group_completion_time_std_mean"], sum(stds) / 4)
    cvs = [stds[0] / 5.4375, 0.2, 0.0]  # a, b, d
    assert math.isclose(figures["generate/intra_group_completion_time_cv_mean"], sum(cvs) / 3)
    assert group_completion_metrics([GROUPS[2]]) == {
        "generate/group_completion_time_mean": 2.5,
        "generate/group_completion_time_p90": 2.5,
        "generate/group_completion_time_max": 2.5,
    }
    assert group_completion_metrics([GROUPS[4]]) == {}


# ---------------------------------------------------------------- logged by fully async steps
FULLY_ASYNC = (
    "trainer.fully_async.enabled=true",
    "trainer.fully_async.max_staleness_steps=1",
    "trainer.fully_async.num_parallel_generation_workers=6",
    "trainer.algorithm.use_tis=true",
    "trainer.algorithm.tis_imp_ratio_cap=2.0",
)
OVERHEAD_S = 0.5  # what a group's generation takes beyond its slowest rollout


def seconds(prompt: int, sample: int) -> float:
    """A rollout's completion seconds: prompt i's two samples take i + 1 and i + 4."""
    return prompt + 1.0 + 3.0 * sample


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ClockedFake(FakeGenerator):
    """The fake generator's rollouts timed by `seconds`; each call moves the clock by its slowest
    rollout and `OVERHEAD_S`. Without `delay_s` a call never yields, so the clock moves for one
    group at a time and a group's measured seconds are exactly its call's."""

    clock: FakeClock = field(default_factory=FakeClock)

    async def generate(
        self, rows: Any, n: int, params: Any, policy_version: int = 0, seeds: Any = None
    ) -> Any:
        out = await super().generate(rows, n, params, policy_version, seeds)
        for tr in out:
            prompt, index = tr.response_ids[0] - 10, tr.response_ids[1] - 10
            tr.timing = {"completion": seconds(prompt, index)}
        self.clock.now += max(tr.timing["completion"] for tr in out) + OVERHEAD_S
        return out


def expected(measured: list[int], prompts: list[int]) -> dict[str, float]:
    """The figures of groups `prompts` (two samples each) of which `measured` were timed."""
    out: dict[str, float] = {}
    if measured:
        times = [p + 4.0 + OVERHEAD_S for p in measured]
        out["group_completion_time_mean"] = float(np.mean(times))
        out["group_completion_time_p90"] = float(np.percentile(times, 90))
        out["group_completion_time_max"] = float(np.max(times))
    if prompts:
        out["intra_group_completion_time_std_mean"] = 1.5  # samples i + 1 and i + 4
        out["intra_group_completion_time_cv_mean"] = float(np.mean([1.5 / (p + 2.5) for p in prompts]))
    return out


def assert_logged(step: dict[str, float], view: str, want: dict[str, float]) -> None:
    got = {
        k.split("/", 1)[1]: v for k, v in step.items() if k.startswith(f"{view}/") and "group_completion" in k
    }
    assert set(got) == set(want), view
    for name, value in want.items():
        assert math.isclose(got[name], value, rel_tol=1e-12), f"{view}/{name}"


def _fit(run: FakeRun) -> list[dict[str, float]]:
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert [metrics for _, metrics in run.tracker.logged] == [
        {k: v for k, v in h.items() if k != "step"} for h in history
    ]
    return history


def test_fully_async_steps_log_their_groups_completion_seconds(tmp_path: Path) -> None:
    generator = ClockedFake()
    run = fake_run(tmp_path, *FULLY_ASYNC, generator=generator)
    run.trainer.source.clock = generator.clock  # type: ignore[attr-defined]
    history = _fit(run)
    assert len(history) == 4
    for step, trained in zip(history, run.policy.trained, strict=True):
        prompts = sorted({prompt for prompt, _, _ in trained})
        assert len(prompts) == 4
        assert_logged(step, "generate", expected(prompts, prompts))
        assert not any(k.startswith(("generate_kept/", "generate_dropped/")) for k in step)


def test_a_sync_step_logs_no_group_figures(tmp_path: Path) -> None:
    (step,) = _fit(fake_run(tmp_path, "trainer.max_steps=1", generator=ClockedFake()))
    assert step["generate/trajectory_time_completion_max"] > 0
    assert not any("group_completion" in k for k in step)


def test_dropped_group_views_are_skyrls() -> None:
    """sample_full_batch's figures: SkyRL's `_reprefix_metrics` views of kept and dropped groups,
    the headline over both, and `get_metrics_from_generator_output` of the dropped groups' rewards."""
    from collections import defaultdict

    from skylift.compat.skyrl.metrics import dropped_group_metrics

    skyrl = _skyrl_functions("fully_async_trainer.py", ("_reprefix_metrics",))
    skyrl |= _skyrl_functions("generators/utils.py", ("get_metrics_from_generator_output",))
    skyrl["get_metrics_from_generator_output"].__globals__.update(defaultdict=defaultdict, MetricsOutput=dict)
    kept: list[TimedGroup] = [([sample("k", 1.0), sample("k", 3.0)], 3.5)]
    dropped: list[TimedGroup] = [
        ([sample("d1", 2.0), sample("d1", 2.5)], 2.6),  # reward 1
        ([sample("d2", 1.0), sample("d2", 4.0)], 4.1),
    ]
    for tr in dropped[1][0]:
        tr.reward = -0.5
    got = dropped_group_metrics(kept, dropped, n_samples=2)
    rewards = [tr.reward for group, _ in dropped for tr in group]
    uids = [tr.uid for group, _ in dropped for tr in group]
    theirs = skyrl["get_metrics_from_generator_output"]({"rewards": rewards}, uids)
    want = {
        **group_completion_metrics([*kept, *dropped]),
        **skyrl["_reprefix_metrics"](group_completion_metrics(kept), "kept"),
        **skyrl["_reprefix_metrics"](group_completion_metrics(dropped), "dropped"),
        "reward_dropped/avg_pass_at_2": theirs["pass_at_n"],
        "reward_dropped/avg_raw_reward": theirs["avg_score"],
        "reward_dropped/mean_positive_reward": theirs["mean_positive_reward"],
    }
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k]) for k in want)
    assert (
        got["reward_dropped/avg_pass_at_2"] == 0.5
        and got["generate_dropped/group_completion_time_max"] == 4.1
    )
