"""Dynamic sampling with hand-made groups: `filter` keeps only groups with mixed rewards and samples
more rounds; `replace` fills the batch with copies of signal groups."""

from __future__ import annotations

import pytest

from skylift.generator.trajectory import Trajectory
from skylift.rl.dynamic_sampling import dynamic_sample, has_signal, split_groups, step_rows


def _group(uid: str, rewards: list[float]) -> list[Trajectory]:
    return [
        Trajectory(
            uid=uid,
            prompt_ids=[1],
            response_ids=[2],
            loss_mask=[1],
            rollout_logprobs=[-1.0],
            reward=r,
            stop_reason="stop",
        )
        for r in rewards
    ]


def _round(*groups: tuple[str, list[float]]) -> list[Trajectory]:
    return [tr for uid, rewards in groups for tr in _group(uid, rewards)]


def test_groups_and_signal() -> None:
    trajs = _round(("a", [1, 0]), ("b", [1, 1]))
    assert [g[0].uid for g in split_groups(trajs)] == ["a", "b"]
    assert has_signal(_group("a", [1, 0])) and not has_signal(_group("b", [0.5, 0.5]))


def test_filter_keeps_signal_groups_over_rounds() -> None:
    rounds = {1: _round(("c", [0, 0]), ("d", [0, 1])), 2: _round(("e", [1, 0]), ("f", [1, 1]))}
    asked: list[int] = []

    def sample_round(n: int) -> list[Trajectory]:
        asked.append(n)
        return rounds[n]

    out = dynamic_sample(_round(("a", [1, 1]), ("b", [0, 1])), sample_round, "filter", 3, 5)
    assert [tr.uid for tr in out.trajectories] == ["b", "b", "d", "d", "e", "e"]
    assert (out.groups_sampled, out.groups_kept, out.rounds, out.short) == (6, 3, 3, False)
    assert asked == [1, 2]


def test_filter_stops_at_max_sample_batches_and_says_short() -> None:
    out = dynamic_sample(
        _round(("a", [1, 1]), ("b", [0, 1])), lambda n: _round((f"x{n}", [0, 0])), "filter", 2, 3
    )
    assert [tr.uid for tr in out.trajectories] == ["b", "b"]
    assert (out.groups_sampled, out.groups_kept, out.rounds, out.short) == (4, 1, 3, True)


def test_filter_skips_prompts_already_sampled_this_step() -> None:
    out = dynamic_sample(_round(("a", [0, 1])), lambda n: _round(("a", [1, 0])), "filter", 2, 2)
    assert (out.groups_sampled, out.groups_kept, out.short) == (1, 1, True)


def test_replace_fills_the_batch_with_copies_under_their_own_uid() -> None:
    def never(n: int) -> list[Trajectory]:
        raise AssertionError("replace samples no extra round while some group has a signal")

    first = _round(("a", [1, 1]), ("b", [0, 1]), ("c", [0, 0]))
    out = dynamic_sample(first, never, "replace", 3, 4, seed=3)
    uids = [tr.uid for tr in out.trajectories]
    assert uids == ["b", "b", "b#copy1", "b#copy1", "b#copy2", "b#copy2"]
    assert [tr.reward for tr in out.trajectories] == [0, 1] * 3
    assert (out.groups_kept, out.rounds, out.short) == (3, 1, False)


def test_replace_samples_more_only_when_no_group_has_a_signal() -> None:
    first = _round(("a", [1, 1]), ("b", [0, 0]))
    out = dynamic_sample(first, lambda n: _round(("c", [0, 1]), ("d", [1, 1])), "replace", 2, 3)
    assert [tr.uid for tr in out.trajectories] == ["c", "c", "c#copy1", "c#copy1"]
    assert out.rounds == 2
    # still none after all rounds: the first round as it is, said to be short
    flat = dynamic_sample(first, lambda n: _round((f"z{n}", [1, 1])), "replace", 2, 2)
    assert [tr.uid for tr in flat.trajectories] == ["a", "a", "b", "b"] and flat.short


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="dynamic sampling type 'keep'"):
        dynamic_sample([], lambda n: [], "keep", 1, 1)
    with pytest.raises(ValueError, match="max_sample_batches=0 must be >= 1"):
        dynamic_sample([], lambda n: [], "filter", 1, 0)


def test_replace_samples_until_min_replace_ratio() -> None:
    first = _round(("a", [0, 1]), ("b", [0, 0]), ("c", [1, 1]), ("d", [1, 1]))
    rounds = {1: _round(("e", [1, 1])), 2: _round(("f", [1, 0]))}
    out = dynamic_sample(first, rounds.__getitem__, "replace", 4, None, min_replace_ratio=0.5)
    # ceil(0.5 * 4) = 2 signal groups needed: round 1 brings none, round 2 brings f
    assert out.rounds == 3 and not out.short
    assert [tr.uid for tr in out.trajectories][:4] == ["a", "a", "f", "f"]
    assert len(out.trajectories) == 8


def test_no_limit_stops_when_the_data_runs_out() -> None:
    supply = iter([_round(("b", [1, 1])), _round(("a", [0, 0]))])
    out = dynamic_sample(_round(("a", [0, 1])), lambda n: next(supply, []), "filter", 3, None)
    assert (out.rounds, out.groups_kept, out.short) == (3, 1, True)


def test_step_rows_are_the_steps_own_draw_without_the_rows_taken() -> None:
    first = step_rows(20, 3, 5, 0, 4, lambda i: i < 10)
    assert len(first) == 4 and all(i >= 10 for i in first)
    assert step_rows(20, 3, 5, 0, 4, lambda i: i < 10) == first  # a resumed run draws the same
    assert step_rows(20, 3, 6, 0, 4, lambda i: i < 10) != first  # another step, another draw
    rest = step_rows(20, 3, 5, 4, 10, lambda i: i < 10)
    assert len(rest) == 6 and not set(rest) & set(first)  # the data runs out after 10 free rows
    assert step_rows(20, 3, 5, 10, 4, lambda i: i < 10) == []


def test_filter_takes_an_oversampled_first_round_without_sampling_more() -> None:
    def no_more(n: int) -> list[Trajectory]:
        raise AssertionError("the oversampled first round already held the batch")

    first = _round(("a", [1, 1]), ("b", [0, 1]), ("c", [1, 0]), ("d", [0, 1]))
    out = dynamic_sample(first, no_more, "filter", 2, 2)
    assert [tr.uid for tr in out.trajectories] == ["b", "b", "c", "c"]
    assert (out.groups_sampled, out.groups_kept, out.rounds, out.short) == (4, 2, 1, False)


def test_an_oversampled_round_gives_a_batch_of_train_batch_size_groups() -> None:
    first = _round(("a", [1, 1]), ("b", [0, 1]), ("c", [1, 0]), ("d", [0, 1]))
    out = dynamic_sample(first, lambda n: [], "replace", 2, 1)
    assert [tr.uid for tr in out.trajectories] == ["b", "b", "c", "c"]
    flat = _round(("a", [1, 1]), ("b", [0, 0]), ("c", [1, 1]))
    for mode in ("filter", "replace"):  # no signal anywhere: one batch of the round, zero advantages
        out = dynamic_sample(flat, lambda n: [], mode, 2, 1)
        assert [tr.uid for tr in out.trajectories] == ["a", "a", "b", "b"] and out.short
