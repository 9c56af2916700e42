"""One-step-off async training end to end on the tiny model (in-process engine, the generation
driven by a background thread), and the helpers the async tests share. Two engines (Ray actors)
that both serve rollouts and both receive every weight sync run in
tests/integration/test_fully_async.py::test_fully_async_with_ray_engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_rl_trainer import _overrides, arithmetic_data  # noqa: F401 - the fixture is used by name

from skylift.config import load_config
from skylift.rl.build import build_trainer
from skylift.rl.loop import RLTrainer
from skylift.worker.batch import build_sequence_batch

pytestmark = pytest.mark.integration

SEQUENCE = [5, 17, 230, 999, 42, 8, 77, 301, 12, 64]
TOLERANCE = 1e-3  # fp32, trainer (transformers) vs engine (vLLM) logprobs


def _train_rows(history: list[dict]) -> list[dict]:
    return [h for h in history if "reward/mean" in h]


def test_async_three_steps_staleness_bounded(
    arithmetic_data: Path,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    overrides = _overrides(
        arithmetic_data,
        tmp_path,
        tiny_model_dir,
        **{
            "trainer.placement.backend": "local",  # the engine's AsyncLLM lives on the trainer's loop
            "trainer.async_training": True,
            "trainer.max_staleness_steps": 1,
            "trainer.max_steps": 3,
            "trainer.eval_before_train": False,
            "trainer.eval_interval": 3,
            "trainer.ckpt_interval": -1,
        },
    )
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    rows = _train_rows(history)
    assert [h["step"] for h in rows] == [1, 2, 3]
    for row in rows:
        # the trainer's version before the update, and the versions the rollouts were sampled with
        assert row["async/policy_version"] == row["step"] - 1
        staleness = row["async/policy_version"] - row["async/rollout_version_min"]
        assert staleness == row["async/staleness_max"] <= 1
        assert row["timing/wait_s"] >= 0 and row["timing/idle_s"] >= 0
        assert row["policy/grad_norm"] > 0
    # step 1 generates first; steps 2 and 3 train on rollouts sampled before the previous update
    assert [h["async/staleness_max"] for h in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["policy/logprob_diff_vs_rollout"] < TOLERANCE  # same weights at step 1
    assert "eval/accuracy" in rows[-1]
    assert trainer.state.policy_version == 3 and trainer.parts.weights.version == 3


def _engine_logprobs(trainer: RLTrainer) -> list[list[float]]:
    assert trainer.parts.engines is not None

    async def each() -> list[list[float]]:
        outs = await asyncio.gather(*(e.prompt_logprobs([SEQUENCE]) for e in trainer.parts.engines.engines))
        return [out[0] for out in outs]

    return trainer.parts.loop.run(each())


def _trainer_logprobs(trainer: RLTrainer) -> list[float]:
    assert trainer.parts.policy is not None
    batch = build_sequence_batch([SEQUENCE[:1]], [SEQUENCE[1:]], pad_token_id=trainer.parts.pad_id)
    return trainer.parts.policy.compute_logprobs(batch, 1, 1.0)[0].tolist()
