"""Kill-and-resume: a run killed at random points and resumed from its checkpoints trains on
exactly the prompts an uninterrupted run does (the same multiset of prompt uids, the same number
of steps), for the fully async, one-step-off and dynamic sampling schedules.

The real trainer, rollout sources, checkpoints and data order run over the fakes of `rl_fakes.py`;
groups take a random while to generate, so a fully async run's buffer and requests in flight hold
different prompts at every checkpoint. The fake policy's checkpoint is the list of what it trained
on (what a real model's weights would have learned from): a kill loses the steps after the last
checkpoint, as a real one does. A kill is an exception at a random point of the trainer's thread,
during an update or in the middle of writing a checkpoint; the killed trainer is abandoned and a
fresh one (new parts, new event loop) resumes from the latest complete checkpoint."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rl_fakes import FakeGenerator, FakePolicy, fake_run, row_index

from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.inference.types import SamplingParams
from skylift.rl.checkpoint import latest_checkpoint, load_trainer_state
from skylift.rl.fully_async import StreamPosition
from skylift.rl.sources import FullyAsyncSource

FULLY_ASYNC = (
    "trainer.fully_async.enabled=true",
    "trainer.fully_async.num_parallel_generation_workers=6",
    "trainer.algorithm.use_tis=true",
    "trainer.algorithm.tis_imp_ratio_cap=2.0",
)
# 16 prompts (4 steps an epoch), 10 steps over 3 epochs: a prompt is trained 2 or 3 times
RUN = ("trainer.epochs=3", "trainer.max_steps=10", "trainer.ckpt_interval=2")
NUM_TRAIN = 16
STEPS = 10


class Killed(BaseException):
    """The process died here (not an error any handler of the trainer's catches)."""


@dataclass
class JitteryGenerator(FakeGenerator):
    """Each generation takes a random while (seeded; one in four is slow, as long responses are), so
    groups finish out of data order and batches are not runs of consecutive prompts."""

    rng: random.Random = field(default_factory=random.Random)

    async def generate(
        self,
        rows: list[PromptSample],
        n: int,
        params: SamplingParams,
        policy_version: int = 0,
        seeds: list[int] | None = None,
    ) -> list[Trajectory]:
        slow = self.rng.random() < 0.25
        await asyncio.sleep(self.rng.uniform(0.01, 0.03) if slow else self.rng.uniform(0.0, 0.003))
        return await super().generate(rows, n, params, policy_version, seeds)


@dataclass
class RememberingPolicy(FakePolicy):
    """Its checkpoint holds every mini-batch it trained on; it is killed at its `kill_at`-th
    update or checkpoint (counting both; None: never)."""

    kill_at: int | None = None
    events_seen: int = 0

    def _maybe_die(self) -> None:
        self.events_seen += 1
        if self.kill_at is not None and self.events_seen >= self.kill_at:
            raise Killed

    def train_mini_batch(
        self, batch: Any, objective: Any, micro_batch_size: int, temperature: float
    ) -> dict[str, float]:
        out = super().train_mini_batch(batch, objective, micro_batch_size, temperature)
        self._maybe_die()  # dies after the update: this step is lost unless checkpointed later
        return out

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._maybe_die()  # dies before writing: the `.partial` directory is left behind
        (Path(path) / "trained.json").write_text(json.dumps(self.trained))

    def load_checkpoint(self, path: str) -> None:
        self.trained = [
            [tuple(row) for row in batch] for batch in json.loads((Path(path) / "trained.json").read_text())
        ]


def _prompts(trained: list[list[tuple[int, int, int]]]) -> Counter[int]:
    """How many times each prompt's group was trained (one count per group, not per sample)."""
    return Counter(prompt for batch in trained for prompt, sample, _version in batch if sample == 0)


def _run(
    root: Path, overrides: tuple[str, ...], seed: int, kill_at: int | None
) -> tuple[list[list[Any]], int, bool]:
    """One life of a run in `root` (resuming from its latest checkpoint): (what its model trained
    on, its step, whether it was killed)."""
    policy = RememberingPolicy(kill_at=kill_at)
    generator = JitteryGenerator(rng=random.Random(seed))
    run = fake_run(
        root,
        *overrides,
        "trainer.resume_mode=latest",
        generator=generator,
        policy=policy,
        num_train=NUM_TRAIN,
    )
    killed = False
    try:
        run.trainer.setup()
        run.trainer.fit()
    except Killed:
        killed = True  # abandoned as it is: its loop and generation workers stop with it
    finally:
        run.close()
    return policy.trained, run.trainer.state.global_step, killed


def _killed_and_resumed(
    root: Path, overrides: tuple[str, ...], seed: int, kills: int
) -> tuple[list[list[Any]], int, list[dict[str, Any]]]:
    """The run killed `kills` times at random points, resumed after each; (what the final model
    trained on, its steps, the rollout state of every checkpoint a life resumed from)."""
    rng = random.Random(seed)
    resumed_from: list[dict[str, Any]] = []
    for life in range(kills + 1):
        latest = latest_checkpoint(root / "ckpts")
        if latest is not None:
            resumed_from.append(load_trainer_state(latest).rollouts)
        done = load_trainer_state(latest).global_step if latest is not None else 0
        # an update and a checkpoint every other step are left: die somewhere among them
        kill_at = rng.randint(1, (STEPS - done) * 3 // 2) if life < kills else None
        trained, step, killed = _run(root, overrides, seed * 10 + life, kill_at)
        assert killed == (life < kills)
    return trained, step, resumed_from


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("staleness", [1, 2])
def test_fully_async_killed_three_times_trains_on_the_uninterrupted_runs_prompts(
    tmp_path: Path, seed: int, staleness: int
) -> None:
    overrides = (*FULLY_ASYNC, f"trainer.fully_async.max_staleness_steps={staleness}", *RUN)
    whole, whole_steps, _ = _run(tmp_path / "whole", overrides, seed, None)
    trained, steps, resumed_from = _killed_and_resumed(tmp_path / "killed", overrides, seed, kills=3)
    assert whole_steps == steps == len(trained) == len(whole) == STEPS
    expected = Counter({p: 0 for p in range(NUM_TRAIN)})  # every prompt of the data order, once a visit
    for step in range(STEPS):
        expected.update(p for p, s, _ in whole[step] if s == 0)
    assert _prompts(whole) == expected  # the uninterrupted run trains each prompt of its steps once
    assert _prompts(trained) == _prompts(whole)
    assert all(len(batch) == 4 * 2 for batch in trained)  # 4 groups of 2 samples a step
    saved = [StreamPosition.from_dict(state["fully_async"]) for state in resumed_from if state]
    assert all(p < at.next_position for at in saved for p in at.pending)


@pytest.mark.parametrize(
    "schedule",
    [
        ("trainer.async_training=true",),
        (
            "trainer.async_training=true",
            "trainer.algorithm.dynamic_sampling.type=filter",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
        ),
        ("trainer.algorithm.dynamic_sampling.type=replace",),
    ],
    ids=["one_step_off", "dynamic_sampling_one_step_off", "dynamic_sampling_replace"],
)
def test_one_step_off_and_dynamic_sampling_killed_and_resumed_train_on_the_same_prompts(
    tmp_path: Path, schedule: tuple[str, ...]
) -> None:
    overrides = (*schedule, *RUN)
    whole, whole_steps, _ = _run(tmp_path / "whole", overrides, 0, None)
    trained, steps, _ = _killed_and_resumed(tmp_path / "killed", overrides, 0, kills=3)
    assert whole_steps == steps == len(trained) == STEPS
    assert _prompts(trained) == _prompts(whole)


def test_a_fully_async_checkpoint_records_what_was_buffered_or_in_flight(tmp_path: Path) -> None:
    """Generation runs ahead of training: at a checkpoint some prompts were started and not
    trained; the resumed run generates exactly those first, then goes on from the next position."""
    overrides = (*FULLY_ASYNC, "trainer.fully_async.max_staleness_steps=2", *RUN)
    _run(tmp_path, overrides, 0, 4)  # killed at step 3's update, after step 2's checkpoint
    at = StreamPosition.from_dict(
        load_trainer_state(tmp_path / "ckpts" / "global_step_2").rollouts["fully_async"]
    )
    assert at.batch_size == 4 and at.pending and at.next_position > 8  # ran ahead of step 2's 8 prompts
    assert len(at.pending) == at.next_position - 8  # started, less the 8 groups steps 1-2 trained
    assert at.next_position <= (2 + 2 + 1) * 4  # the staleness gate's bound at version 2
    run = fake_run(tmp_path, *overrides, "trainer.resume_mode=latest", num_train=NUM_TRAIN)
    try:
        run.trainer.setup()
        run.trainer.step()
        source = run.trainer.source
        assert isinstance(source, FullyAsyncSource)
        expected = [*at.pending, *range(at.next_position, at.next_position + 6)]  # pending first
        started = [c.rows[0] for c in run.generator.calls]
        assert started[: len(expected)] == [row_index(source.rows.at(p)[0]) for p in expected][: len(started)]
    finally:
        run.close()


def test_a_checkpoint_of_another_batch_size_is_refused_with_the_key_to_set(tmp_path: Path) -> None:
    overrides = (*FULLY_ASYNC, "trainer.fully_async.max_staleness_steps=1", *RUN)
    _run(tmp_path, overrides, 0, 4)
    run = fake_run(
        tmp_path,
        *overrides,
        "trainer.resume_mode=latest",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.fully_async.num_parallel_generation_workers=2",
        num_train=NUM_TRAIN,
    )
    try:
        with pytest.raises(ValueError, match="trainer.train_batch_size=4"):
            run.trainer.setup()
    finally:
        run.close()
