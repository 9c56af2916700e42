"""The RL loop over fake parts (`rl_fakes.py`): every schedule, dynamic sampling, resume and
engine loss, each checked by what the steps generated, trained and synced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from rl_fakes import FakeGenerator, FakeRun, fake_run, row_index

from skylift.inference.pool import NoHealthyEngineError
from skylift.rl.checkpoint import latest_checkpoint, load_trainer_state
from skylift.rl.loop import TrainingStoppedError
from skylift.rl.rows import StepRows
from skylift.rl.sampling import rollout_seeds

BATCH = 4  # prompts per step (rl_fakes.fake_config)
N = 2  # samples per prompt


def _fit(run: FakeRun) -> list[dict[str, float]]:
    try:
        return [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()


def _rows(run: FakeRun) -> StepRows:
    t = run.trainer.cfg.trainer
    return StepRows(run.trainer.parts.train_data, t.train_batch_size, t.seed)  # type: ignore[arg-type]


def _groups(trained: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """prompt index -> the versions of its samples in one trained mini-batch."""
    out: dict[int, list[int]] = {}
    for prompt, _sample, version in trained:
        out.setdefault(prompt, []).append(version)
    return out


def test_sync_steps_generate_their_batch_train_on_policy_and_sync_every_update(tmp_path: Path) -> None:
    run = fake_run(tmp_path, generator=FakeGenerator(delay_s=0.01))
    rows = _rows(run)
    cfg = run.trainer.cfg
    history = _fit(run)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    calls = run.generator.calls
    assert [c.rows for c in calls] == [[row_index(r) for r in rows.batch(s)] for s in range(4)]
    assert [c.version for c in calls] == [0, 1, 2, 3]  # the engines hold the policy of the step
    assert calls[2].seeds == rollout_seeds(cfg, rows.batch(2), 2)
    assert run.weights.syncs == [1, 2, 3, 4]
    for step, trained in enumerate(run.policy.trained):
        groups = _groups(trained)
        assert sorted(groups) == sorted(calls[step].rows)
        assert all(versions == [step] * N for versions in groups.values())
    for h in history:
        assert h["timing/generate_s"] >= 0.01 and h["timing/wait_s"] == h["timing/generate_s"]
    assert run.trainer.state.policy_version == 4 and run.trainer.state.global_step == 4
    assert [step for step, _ in run.tracker.logged] == [1, 2, 3, 4]


def test_evaluation_syncs_first_and_samples_the_held_out_prompts(tmp_path: Path) -> None:
    run = fake_run(
        tmp_path,
        "trainer.eval_interval=2",
        "trainer.eval_before_train=true",
        "generator.eval_n_samples_per_prompt=1",
    )
    history = run.trainer.fit()
    run.close()
    evals = [h for h in history if "eval/accuracy" in h]
    assert [h["step"] for h in evals] == [0, 2, 4]
    eval_calls = [c for c in run.generator.calls if c.n == 1]
    assert [c.rows for c in eval_calls] == [[0, 1, 2, 3]] * 3  # the 4 held-out prompts, each time
    assert [c.version for c in eval_calls] == [0, 2, 4]  # the policy of the step


@pytest.mark.parametrize(("staleness", "syncs"), [(1, [1, 2, 3, 4]), (2, [2, 4])])
def test_one_step_off_generates_the_next_step_while_training(
    tmp_path: Path, staleness: int, syncs: list[int]
) -> None:
    run = fake_run(
        tmp_path,
        "trainer.async_training=true",
        f"trainer.max_staleness_steps={staleness}",
        generator=FakeGenerator(delay_s=0.01),
    )
    rows = _rows(run)
    history = _fit(run)
    calls = run.generator.calls
    # no generation beyond the last step; every one on the run's loop thread
    assert [c.rows for c in calls] == [[row_index(r) for r in rows.batch(s)] for s in range(4)]
    assert {c.thread for c in calls} == {"fake-run-loop"}
    assert run.weights.syncs == syncs
    # step s+1 was launched before step s's sync: its rollouts are one version (or more) behind
    trained_versions = [sorted({v for _, _, v in trained}) for trained in run.policy.trained]
    expected = [[0], [0], [1], [2]] if staleness == 1 else [[0], [0], [0], [2]]
    assert trained_versions == expected
    lags = [step - versions[0] for step, versions in enumerate(trained_versions)]
    assert max(lags) == staleness
    assert [h["async/staleness_max"] for h in history] == [float(lag) for lag in lags]


@pytest.mark.parametrize("staleness", [1, 2])
def test_fully_async_keeps_every_batch_within_the_staleness_bound(tmp_path: Path, staleness: int) -> None:
    run = fake_run(
        tmp_path,
        "trainer.fully_async.enabled=true",
        f"trainer.fully_async.max_staleness_steps={staleness}",
        "trainer.fully_async.num_parallel_generation_workers=6",
        "trainer.algorithm.use_tis=true",
        "trainer.algorithm.tis_imp_ratio_cap=2.0",
        generator=FakeGenerator(delay_s=0.005),
        update_s=0.05,  # generation runs ahead while the policy trains
    )
    history = _fit(run)
    assert run.weights.labels == 1  # the engines were told their version before generating
    assert run.weights.syncs == [1, 2, 3, 4]  # a sync after every update
    calls = run.generator.calls
    assert all(len(c.rows) == 1 for c in calls)  # one prompt group per generation
    assert {c.thread for c in calls} == {"fake-run-loop"}
    for step, trained in enumerate(run.policy.trained):
        groups = _groups(trained)
        assert len(groups) == BATCH
        assert all(0 <= step - v <= staleness for versions in groups.values() for v in versions)
    for h in history:
        assert h["fully_async/token_staleness_max"] <= staleness
        assert h["timing/wait_s"] == h["fully_async/wait_s"]
    # the gate admits staleness + 1 batches at version 0 before the first update: those started
    # ahead are trained later, stale by one version a step up to the bound, never more
    lags = [h["async/staleness_max"] for h in history]
    assert lags[: staleness + 1] == [float(lag) for lag in range(staleness + 1)]
    assert max(lags) == staleness
    assert run.trainer.source.stream is None  # type: ignore[attr-defined]  # closed by fit


def _even_prompts_are_solved(row: int, sample: int, version: int) -> float:
    """Even prompts: every sample right (no signal); odd ones: mixed."""
    return 1.0 if row % 2 == 0 else float(sample % 2)


def test_dynamic_sampling_filter_trains_only_groups_with_a_signal(tmp_path: Path) -> None:
    run = fake_run(
        tmp_path,
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.gen_batch_size=6",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=5",
        generator=FakeGenerator(reward=_even_prompts_are_solved),
    )
    rows = _rows(run)
    history = _fit(run)
    calls = run.generator.calls
    first = [row_index(r) for r in rows.batch(0)]
    assert calls[0].rows[:BATCH] == first and len(calls[0].rows) == 6  # oversampled first round
    extra = rows.draw(0, 0, 2, {rows.batch(0)[i].uid for i in range(BATCH)})
    assert calls[0].rows[BATCH:] == [row_index(r) for r in extra]
    for trained, h in zip(run.policy.trained, history, strict=True):
        groups = _groups(trained)
        assert all(p % 2 == 1 for p in groups)  # only groups whose rewards differ
        assert len(groups) == h["dynamic_sampling/groups_kept"] == BATCH
        sampled = 6 + 6 * (h["dynamic_sampling/rounds"] - 1)
        assert h["dynamic_sampling/groups_sampled"] <= sampled
    assert any(h["dynamic_sampling/rounds"] > 1 for h in history)


def test_fully_async_sample_full_batch_trains_only_groups_with_a_signal_and_ends_when_data_runs_out(
    tmp_path: Path,
) -> None:
    """SkyRL's sample_full_batch: groups whose rewards are all equal are dropped as they finish and
    not generated again; with half the prompts such, 32 prompts give 4 batches of 4, so a run
    asking for 8 steps ends after 4 with a checkpoint."""
    run = fake_run(
        tmp_path,
        "trainer.fully_async.enabled=true",
        "trainer.fully_async.sample_full_batch=true",
        "trainer.algorithm.zero_variance_filter=true",
        "trainer.fully_async.max_staleness_steps=1",
        "trainer.algorithm.use_tis=true",
        "trainer.algorithm.tis_imp_ratio_cap=2.0",
        "trainer.max_steps=8",
        "trainer.ckpt_interval=3",
        generator=FakeGenerator(reward=_even_prompts_are_solved),
    )
    history = _fit(run)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for trained in run.policy.trained:
        groups = _groups(trained)
        assert len(groups) == BATCH and all(p % 2 == 1 for p in groups)
    generated = [row for c in run.generator.calls for row in c.rows]
    assert sorted(generated) == sorted(set(generated)) and len(generated) == 32  # none generated twice
    dropped = [h["async/num_groups_dropped"] for h in history]
    assert 0 < sum(dropped) <= 16  # the even prompts, as they finished before each batch was full
    assert all(h["async/keep_rate"] == BATCH / (BATCH + d) for h, d in zip(history, dropped, strict=True))
    for h, d in zip(history, dropped, strict=True):  # SkyRL's views of the dropped groups
        if d:
            assert h["reward_dropped/avg_raw_reward"] == 1.0 and h[f"reward_dropped/avg_pass_at_{N}"] == 1.0
            assert h["generate_dropped/group_completion_time_mean"] >= 0
            assert (
                "generate_kept/group_completion_time_max" in h and "generate/group_completion_time_p90" in h
            )
        else:
            assert not any(k.startswith(("reward_dropped/", "generate_dropped/")) for k in h)
    assert (
        latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "global_step_4"
    )  # saved at the early end
    assert load_trainer_state(tmp_path / "ckpts" / "global_step_4").global_step == 4


def test_without_sample_full_batch_running_out_of_data_is_still_an_error(tmp_path: Path) -> None:
    from skylift.rl.fully_async import RolloutsExhausted

    run = fake_run(
        tmp_path,
        "trainer.fully_async.enabled=true",
        "trainer.algorithm.use_tis=true",
        "trainer.algorithm.tis_imp_ratio_cap=2.0",
        num_train=8,
    )
    run.trainer.total_steps = 3  # more steps than 8 prompts make
    with pytest.raises(RolloutsExhausted, match="data ran out with 0 of 4"):
        _fit(run)


@pytest.mark.parametrize("one_step_off", [False, True])
def test_dynamic_sampling_replace_fills_the_batch_with_copies(tmp_path: Path, one_step_off: bool) -> None:
    run = fake_run(
        tmp_path,
        "trainer.algorithm.dynamic_sampling.type=replace",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=1",
        f"trainer.async_training={str(one_step_off).lower()}",
        generator=FakeGenerator(reward=_even_prompts_are_solved),
    )
    history = _fit(run)
    assert len(run.generator.calls) == 4  # one round a step: no extra sampling
    for trained, h in zip(run.policy.trained, history, strict=True):
        assert len(trained) == BATCH * N
        assert all(p % 2 == 1 for p, _, _ in trained)  # solved groups replaced by copies of others
        assert h["dynamic_sampling/rounds"] == 1
        assert h["dynamic_sampling/groups_kept"] == BATCH


def test_dynamic_sampling_around_one_step_off_samples_extra_rounds_before_the_prefetch(
    tmp_path: Path,
) -> None:
    run = fake_run(
        tmp_path,
        "trainer.async_training=true",
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=4",
        generator=FakeGenerator(reward=_even_prompts_are_solved),
    )
    rows = _rows(run)
    _fit(run)
    calls = run.generator.calls
    batches = [{row_index(r) for r in rows.batch(step)} for step in range(4)]
    # each step's batch is generated once (the prefetch, on the run's loop thread like every call)
    firsts = [i for i, c in enumerate(calls) if set(c.rows) in batches]
    assert len(firsts) == 4 and firsts[0] == 0
    assert {c.thread for c in calls} == {"fake-run-loop"}
    for step, start in enumerate(firsts):  # a step's extra rounds come before the next prefetch
        end = firsts[step + 1] if step + 1 < len(firsts) else len(calls)
        batch = {row_index(r) for r in rows.batch(step)}
        assert set(run.generator.calls[start].rows) == batch
        for call in run.generator.calls[start + 1 : end]:
            assert not set(call.rows) & batch  # extra prompts of the step's own draw
    for trained in run.policy.trained:
        assert all(p % 2 == 1 for p in _groups(trained))


def test_resumed_run_generates_what_an_uninterrupted_run_does(tmp_path: Path) -> None:
    whole = fake_run(tmp_path / "whole", "trainer.max_steps=4")
    _fit(whole)
    first = fake_run(tmp_path / "resumed", "trainer.max_steps=2", "trainer.ckpt_interval=2")
    _fit(first)
    assert latest_checkpoint(tmp_path / "resumed" / "ckpts") is not None
    second = fake_run(tmp_path / "resumed", "trainer.max_steps=4", "trainer.resume_mode=latest")
    second.trainer.setup()
    assert second.trainer.state.global_step == 2 and second.trainer.state.policy_version == 2
    assert second.policy.loaded == [str(tmp_path / "resumed" / "ckpts" / "global_step_2" / "policy")]
    assert second.weights.syncs == [2]  # the engines get the checkpoint's weights
    history = _fit(second)
    assert [h["step"] for h in history] == [3, 4]
    resumed = [(c.rows, c.seeds, c.version) for c in second.generator.calls]
    assert resumed == [(c.rows, c.seeds, c.version) for c in whole.generator.calls[2:]]


def test_losing_every_engine_saves_the_last_step_and_says_how_to_resume(tmp_path: Path) -> None:
    generator = FakeGenerator(fail_after_calls=2, fail_with=lambda: NoHealthyEngineError("engine 0: refused"))
    run = fake_run(tmp_path, generator=generator)
    with pytest.raises(TrainingStoppedError, match="resume_mode=latest") as stopped:
        run.trainer.fit()
    run.close()
    assert "during step 3" in str(stopped.value) and "saved step 2" in str(stopped.value).lower()
    assert latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "global_step_2"
    assert run.trainer.state.global_step == 2 and len(run.policy.trained) == 2


def test_losing_every_engine_one_step_off_saves_the_last_counted_step(tmp_path: Path) -> None:
    """Step 3's prompts are generated (and fail) while step 2 trains: step 2 still syncs, counts and
    is saved with the policy of two updates; the stop names step 3."""
    generator = FakeGenerator(fail_after_calls=2, fail_with=lambda: NoHealthyEngineError("engine 0: refused"))
    run = fake_run(tmp_path, "trainer.async_training=true", generator=generator)
    with pytest.raises(TrainingStoppedError, match="resume_mode=latest") as stopped:
        run.trainer.fit()
    run.close()
    assert "during step 3" in str(stopped.value) and "saved step 2" in str(stopped.value).lower()
    assert latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / "global_step_2"
    saved = load_trainer_state(tmp_path / "ckpts" / "global_step_2")
    assert (
        (saved.global_step, saved.policy_version)
        == (2, 2)
        == (len(run.policy.trained), run.weights.syncs[-1])
    )


def test_losing_every_engine_fully_async_saves_the_step_it_counted_last(tmp_path: Path) -> None:
    """Generation runs ahead on its own thread; its failure stops the run when a step takes its
    batch, so the saved step is the last counted one, with as many updates as steps."""
    generator = FakeGenerator(
        delay_s=0.005, fail_after_calls=2 * BATCH, fail_with=lambda: NoHealthyEngineError("engine 0: refused")
    )
    run = fake_run(
        tmp_path,
        "trainer.fully_async.enabled=true",
        "trainer.fully_async.max_staleness_steps=1",
        "trainer.algorithm.use_tis=true",
        "trainer.algorithm.tis_imp_ratio_cap=2.0",
        generator=generator,
        update_s=0.02,
    )
    with pytest.raises(TrainingStoppedError, match="resume_mode=latest") as stopped:
        run.trainer.fit()
    run.close()
    step = run.trainer.state.global_step
    assert step in (1, 2)  # the failure reaches the trainer at step 2's or step 3's take
    assert (
        f"during step {step + 1}" in str(stopped.value) and f"saved step {step}" in str(stopped.value).lower()
    )
    saved = load_trainer_state(tmp_path / "ckpts" / f"global_step_{step}")
    assert (saved.global_step, saved.policy_version, len(run.policy.trained)) == (step, step, step)
    assert run.trainer.source.stream is None  # type: ignore[attr-defined]  # its workers stopped


@dataclass
class FakeEngines:
    """The pool's health: engine 0 fails once the generator has served `healthy_calls` calls."""

    generator: FakeGenerator
    healthy_calls: int

    @property
    def failures(self) -> dict[int, str]:
        return {0: "refused"} if len(self.generator.calls) > self.healthy_calls else {}

    @property
    def live_indices(self) -> list[int]:
        return [1] if self.failures else [0, 1]


def test_losing_one_engine_trains_on_and_reports_the_live_ones(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    run.trainer.parts.engines = FakeEngines(run.generator, healthy_calls=2)
    history = _fit(run)
    assert [h["step"] for h in history] == [1, 2, 3, 4] and run.weights.syncs == [1, 2, 3, 4]
    assert ["engines/live" in h for h in history] == [False, False, True, True]
    assert [h["engines/live"] for h in history[2:]] == [1.0, 1.0]


def test_colocated_engines_sleep_between_generation_and_training(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=2")
    run.trainer.parts.sleep_engines = True
    _fit(run)
    assert run.weights.sleeps == 2
    first = [c.rows[0] for c in run.generator.calls]
    assert run.generator.events == [
        *(f"generate {first[0]} v0", "sleep", "train 1", "sync v1"),
        *(f"generate {first[1]} v1", "sleep", "train 2", "sync v2"),
    ]


def test_resumed_one_step_off_run_generates_the_same_prompts_on_policy_first(tmp_path: Path) -> None:
    """Resuming drops the generation that was in flight: the first resumed step generates with
    the checkpoint's weights, then one step off again; prompts and seeds are the uninterrupted run's."""
    one_step_off = "trainer.async_training=true"
    whole = fake_run(tmp_path / "whole", one_step_off)
    _fit(whole)
    _fit(fake_run(tmp_path / "resumed", one_step_off, "trainer.max_steps=2", "trainer.ckpt_interval=2"))
    second = fake_run(tmp_path / "resumed", one_step_off, "trainer.max_steps=4", "trainer.resume_mode=latest")
    second.trainer.setup()
    assert second.weights.syncs == [2]
    history = _fit(second)
    assert [h["step"] for h in history] == [3, 4]
    calls = second.generator.calls
    assert [(c.rows, c.seeds) for c in calls] == [(c.rows, c.seeds) for c in whole.generator.calls[2:]]
    assert [c.version for c in whole.generator.calls] == [0, 0, 1, 2]
    assert [c.version for c in calls] == [2, 2]  # step 3 on policy, step 4 one version behind
    assert [sorted({v for _, _, v in trained}) for trained in second.policy.trained] == [[2], [2]]
