"""Fully async training end to end on the tiny model (in-process engine, placement "local"):
two steps with a staleness bound of 2, the run resumed as if killed after its first checkpoint
(it trains on the prompts the uninterrupted run did), then weight syncs while requests are in
flight (pause modes keep and abort), after which the engine's logprobs match the trainer's. What the scheduler
puts in each batch (versions, staleness) is asserted deterministically with fake parts in
tests/unit/test_rl_loop.py; here the real engine, workers and syncs run it."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import pytest
from test_async_training import SEQUENCE, TOLERANCE, _engine_logprobs, _train_rows, _trainer_logprobs
from test_rl_trainer import _overrides, arithmetic_data  # noqa: F401 - the fixture is used by name

from skylift.config import load_config
from skylift.config.schema import SkyliftConfig
from skylift.generator import Trajectory
from skylift.inference.types import SamplingParams
from skylift.rl import checkpoint as ckpt
from skylift.rl.build import build_trainer, make_source
from skylift.rl.loop import RLTrainer
from skylift.utils.loop_thread import LoopThread
from skylift.worker.batch import build_sequence_batch

pytestmark = pytest.mark.integration

BOUND = 2
LONG = SamplingParams(max_tokens=500, ignore_eos=True, temperature=1.0, seed=3)


def _versions_after_sync_in_flight(trainer: RLTrainer, loop: LoopThread, mode: str) -> list[int]:
    """Start a long request, train one update meanwhile and sync (pausing the engine with `mode`)
    while the request is still running; the token versions of what it sampled."""
    assert trainer.parts.engines is not None and trainer.parts.weights is not None
    prompt = SEQUENCE[:4]
    rows = [trainer.parts.train_data[i] for i in range(4)]
    sampler = trainer.source.sampler  # type: ignore[attr-defined]
    groups = [loop.submit(sampler.coroutine([row], 0)).result(120) for row in rows]
    trainer.update([tr for g in groups for tr in g])  # the policy moves on: version + 1
    request = loop.submit(trainer.parts.engines.generate([prompt], LONG))
    time.sleep(0.1)  # some tokens with the engine's weights (a fast machine makes 500 in ~0.5 s)
    assert not request.done(), "the request finished before the sync: make it longer"
    trainer.parts.weights.pause_mode = mode  # type: ignore[attr-defined]
    trainer.parts.weights.sync(trainer.state.policy_version)
    completion = request.result(300)[0].completions[0]
    if mode == "abort":
        assert completion.stop_reason == "abort"
        generator = trainer.parts.generator
        generator.settings.resubmit_aborted = True
        completion = loop.submit(generator._resubmitted(prompt, completion, LONG)).result(300)
    assert len(completion.token_ids) == LONG.max_tokens
    assert completion.token_versions is not None
    return completion.token_versions


def _record_prompts(trainer: RLTrainer) -> list[list[str]]:
    """The prompt uids of every batch the trainer updates on from now on (one per group)."""
    batches: list[list[str]] = []
    update = trainer.update

    def recorded(trajectories: list[Trajectory]) -> dict[str, float]:
        batches.append(sorted({tr.uid for tr in trajectories}))
        return update(trajectories)

    trainer.update = recorded  # type: ignore[method-assign]
    return batches


def _resumed_after_kill(trainer: RLTrainer, cfg: SkyliftConfig, step: int) -> RLTrainer:
    """A fresh trainer and rollout source over the same engines and workers, resumed from the
    checkpoint of `step`: the run as if killed after it (its generation ahead is lost)."""
    path = ckpt.step_dir(trainer.parts.ckpt_dir, step)
    cfg = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode="from_path", resume_path=str(path))
    )
    sampler = trainer.source.sampler  # type: ignore[attr-defined]
    source = make_source(cfg, trainer.parts, sampler, trainer.total_steps, lambda _line: None)
    resumed = RLTrainer(cfg, trainer.parts, source, trainer.eval_sampler, trainer.total_steps)
    resumed.close_parts = trainer.close_parts
    return resumed


def _engine_vs_trainer(trainer: RLTrainer, loop: LoopThread) -> float:
    assert trainer.parts.engines is not None and trainer.parts.policy is not None
    engine = loop.submit(trainer.parts.engines.prompt_logprobs([SEQUENCE])).result(120)[0]
    batch = build_sequence_batch([SEQUENCE[:1]], [SEQUENCE[1:]], pad_token_id=trainer.parts.pad_id)
    expected = trainer.parts.policy.compute_logprobs(batch, 1, 1.0)[0].tolist()
    return max(abs(a - b) for a, b in zip(engine, expected, strict=True))


def test_fully_async_two_steps_and_syncs_in_flight(
    arithmetic_data: Path,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    overrides = _overrides(
        arithmetic_data,
        tmp_path,
        tiny_model_dir,
        **{
            "trainer.placement.backend": "local",
            "trainer.fully_async.enabled": True,
            "trainer.fully_async.max_staleness_steps": BOUND,
            "trainer.fully_async.num_parallel_generation_workers": 4,
            "generator.max_generate_length": 128,  # generation outlasts a tiny update: syncs hit requests in flight
            "trainer.algorithm.use_tis": True,
            "trainer.algorithm.tis_imp_ratio_cap": 2.0,
            "trainer.max_steps": 2,
            "trainer.max_prompt_length": 480,  # room for the long requests below
            "trainer.eval_before_train": False,
            "trainer.eval_interval": -1,
            "trainer.ckpt_interval": 1,
        },
    )
    cfg = load_config(overrides)
    trainer = build_trainer(cfg, console=False)
    try:
        trainer.setup()
        whole = _record_prompts(trainer)
        history = trainer.fit()
        saved = ckpt.load_trainer_state(ckpt.step_dir(trainer.parts.ckpt_dir, 1)).rollouts["fully_async"]
        trainer = _resumed_after_kill(trainer, cfg, 1)
        trainer.setup()
        again = _record_prompts(trainer)
        trainer.fit()
        again = list(again)  # the batches of the resumed run's fit (the checks below update too)
        loop = trainer.parts.loop  # the run's loop thread, still running after fit()
        keep = _versions_after_sync_in_flight(trainer, loop, "keep")
        abort = _versions_after_sync_in_flight(trainer, loop, "abort")
        diff = _engine_vs_trainer(trainer, loop)
    finally:
        trainer.shutdown()

    rows = _train_rows(history)
    for h in rows:
        print({k: v for k, v in h.items() if "async" in k or "timing" in k})
    assert [h["step"] for h in rows] == [1, 2]
    # resumed after step 1: no prompt repeated or skipped, as many steps
    print("step 1's checkpoint:", saved)
    assert len(whole) == 2 and len(again) == 1 and trainer.state.global_step == 2
    assert Counter(whole[0] + again[0]) == Counter(whole[0] + whole[1])
    for row in rows:
        assert row["async/policy_version"] == row["step"] - 1
        assert 0 <= row["async/staleness_max"] <= BOUND
        assert 0 <= row["fully_async/token_staleness_max"] <= BOUND
        assert row["policy/tis_weight_mean"] > 0
        assert row["timing/weight_sync_s"] > 0
    # one request, two policy versions: the tokens before the sync and those after it
    assert keep[0] == 2 and keep[-1] == 3 and sorted(keep) == keep, keep
    assert abort[0] == 3 and abort[-1] == 4 and sorted(abort) == abort, abort
    assert diff < TOLERANCE, f"engine logprobs differ from the trainer's by {diff:.2e} after the syncs"
    assert trainer.parts.weights.version == trainer.state.policy_version == 4


def test_fully_async_with_ray_engines(
    arithmetic_data: Path,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """Placement "ray": two engines, each a Ray actor (it owns vLLM's client), and the policy a Ray
    worker, so the trainer's process only awaits their object refs; the pauses, the token
    versions and the syncs go through the actors. Both engines serve rollouts and both receive
    every weight sync."""
    overrides = _overrides(
        arithmetic_data,
        tmp_path,
        tiny_model_dir,
        **{
            "trainer.placement.backend": "ray",
            "generator.num_inference_engines": 2,
            "generator.weight_sync_backend": "gloo",  # the group path (auto shares memory on one host)
            "trainer.fully_async.enabled": True,
            "trainer.fully_async.max_staleness_steps": BOUND,
            "trainer.fully_async.num_parallel_generation_workers": 4,
            "trainer.fully_async.pause_mode": "abort",  # the local test's runs pause with keep
            "generator.max_generate_length": 128,  # syncs hit requests in flight
            "trainer.algorithm.use_tis": True,
            "trainer.algorithm.tis_imp_ratio_cap": 2.0,
            "trainer.max_steps": 2,
            "trainer.eval_before_train": False,
            "trainer.eval_interval": -1,
            "trainer.ckpt_interval": -1,
        },
    )
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        before = _engine_logprobs(trainer)
        history = trainer.fit()
        assert trainer.parts.engines is not None
        served = list(trainer.parts.engines.sequences_served)
        after = _engine_logprobs(trainer)
        expected = _trainer_logprobs(trainer)
    finally:
        trainer.shutdown()

    rows = _train_rows(history)
    assert [h["step"] for h in rows] == [1, 2]
    for row in rows:
        assert row["async/policy_version"] == row["step"] - 1
        assert 0 <= row["fully_async/token_staleness_max"] <= BOUND
        assert row["policy/tis_weight_mean"] > 0
    # at least 2 batches of 4 prompts x 4 samples, spread over both engines
    assert len(served) == 2 and sum(served) >= 32 and min(served) > 0, served
    assert trainer.parts.weights.version == trainer.state.policy_version == 2
    # forced gloo: the group path, which auto no longer takes on one CPU host
    assert trainer.parts.weights.transport.chosen == "gloo"  # type: ignore[attr-defined]
    changed = max(abs(a - b) for a, b in zip(before[0], expected, strict=True))
    assert changed > 10 * TOLERANCE, "training did not move the logprobs: the check below would be vacuous"
    for index, engine_lp in enumerate(after):
        diff = max(abs(a - b) for a, b in zip(engine_lp, expected, strict=True))
        assert diff < TOLERANCE, (
            f"engine {index}: logprobs differ from the trainer's by {diff:.2e} after the syncs"
        )
