"""SkyRL's ``generate/*`` token figures: equal to SkyRL's own `get_rollout_metrics` (its source,
read from the skyrl 0.4.0 wheel that scripts/setup.sh downloads), logged by training steps and, as
``eval/all/generate/*``, by evaluations."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
from rl_fakes import fake_run
from skyrl_clients import _unpacked, wheel_dir

from skylift.generator.metrics import skyrl_generate_metrics
from skylift.generator.trajectory import Trajectory
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
