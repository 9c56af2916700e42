"""Dynamic sampling (DAPO; `trainer.algorithm.dynamic_sampling`): a prompt group whose
rewards are all equal has zero advantage everywhere and teaches nothing, so fill the batch with
groups that carry a signal.

- `filter`: keep the groups with mixed rewards; while fewer than `train_batch_size` are kept, sample
  another round of prompts, up to `max_sample_batches` rounds in all, then train on what there is.
- `replace`: each group without a signal is replaced by a copy of a group with one (drawn with a
  seeded generator; the copy gets its own uid so it stays a group of its own). Only while fewer
  than `min_replace_ratio` of the batch's groups (at least one) have a signal are more rounds
  sampled (up to `max_sample_batches`), and their signal groups are used before any copy.

With `gen_batch_size` above `train_batch_size` the first round is oversampled: the step's batch
and `gen_batch_size - train_batch_size` more prompts are generated in one call (one batched call
costs less than two calls of half its size: benchmarks/RESULTS.md), and later rounds take `gen_batch_size`
prompts each.

Pure: the caller passes the first round's trajectories and a `sample_round(round)` callable that
generates another round, so this module needs no engine and is tested with hand-made groups.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from skylift.config.algorithm import DYNAMIC_SAMPLING_TYPES
from skylift.generator.trajectory import Trajectory


def split_groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by prompt uid, groups in order of first appearance."""
    groups: dict[str, list[Trajectory]] = {}
    for tr in trajectories:
        groups.setdefault(tr.uid, []).append(tr)
    return list(groups.values())


def has_signal(group: list[Trajectory], tolerance: float = 1e-6) -> bool:
    """Whether the group's rewards differ (its advantages are not all zero)."""
    rewards = [tr.reward for tr in group]
    return max(rewards) - min(rewards) > tolerance


def zero_variance_uids(
    trajectories: list[Trajectory], tolerance: float = 1e-6, rewards: list[float] | None = None
) -> set[str]:
    """Prompt uids of the groups ``trainer.algorithm.zero_variance_filter`` drops: more than one
    *live* trajectory (one with a token that counts in the loss) and all their rewards (`rewards`,
    one per trajectory, else each one's own) within `tolerance` of each other. Groups of one live
    trajectory or fewer are kept."""
    reward_of = {
        id(tr): r for tr, r in zip(trajectories, rewards or [tr.reward for tr in trajectories], strict=True)
    }
    dropped: set[str] = set()
    for group in split_groups(trajectories):
        live = [reward_of[id(tr)] for tr in group if any(tr.loss_mask)]
        if len(live) > 1 and max(live) - min(live) <= tolerance:
            dropped.add(group[0].uid)
    return dropped


@dataclass
class DynamicSample:
    trajectories: list[Trajectory]
    groups_sampled: int  # over all rounds
    groups_kept: int  # groups with a signal in the batch (copies in `replace` included)
    rounds: int
    short: bool  # the batch holds fewer signal groups than asked for


def dynamic_sample(
    first_round: list[Trajectory],
    sample_round: Callable[[int], list[Trajectory]],
    mode: str,
    train_batch_size: int,
    max_sample_batches: int | None,
    min_replace_ratio: float = 0.0,
    seed: int = 0,
) -> DynamicSample:
    """The batch to train on (see the module docstring). `max_sample_batches` counts the first
    round too (1 = no extra sampling; None = until `sample_round` returns no new prompt)."""
    if mode not in DYNAMIC_SAMPLING_TYPES:
        raise ValueError(
            f"dynamic sampling type {mode!r}: expected one of {', '.join(DYNAMIC_SAMPLING_TYPES)}"
        )
    if max_sample_batches is not None and max_sample_batches < 1:
        raise ValueError(f"max_sample_batches={max_sample_batches} must be >= 1")
    limit = math.inf if max_sample_batches is None else max_sample_batches
    groups = split_groups(first_round)
    sampled, rounds = len(groups), 1
    seen = {g[0].uid for g in groups}
    signal = [g for g in groups if has_signal(g)]
    exhausted = False

    def more() -> None:
        nonlocal sampled, rounds, exhausted
        fresh = [g for g in split_groups(sample_round(rounds)) if g[0].uid not in seen]
        rounds += 1
        exhausted = not fresh
        sampled += len(fresh)
        seen.update(g[0].uid for g in fresh)
        signal.extend(g for g in fresh if has_signal(g))

    if mode == "filter":
        while len(signal) < train_batch_size and rounds < limit and not exhausted:
            more()
        kept = signal[:train_batch_size]
        if not kept:  # no group has a signal: a batch of the first round (zero advantages)
            return DynamicSample(_flat(groups[:train_batch_size]), sampled, 0, rounds, True)
        return DynamicSample(_flat(kept), sampled, len(kept), rounds, len(kept) < train_batch_size)
    need = max(1, math.ceil(min_replace_ratio * train_batch_size))
    while len(signal) < need and rounds < limit and not exhausted:
        more()
    if not signal:  # nothing to copy: train on a batch of the first round as it is
        return DynamicSample(_flat(groups[:train_batch_size]), sampled, 0, rounds, True)
    rng = random.Random(seed)
    batch = [g for g in groups if has_signal(g)][:train_batch_size]  # an oversampled round has more
    extra = iter(g for g in signal if g[0].uid not in {b[0].uid for b in batch})
    copies = 0
    while len(batch) < train_batch_size:
        group = next(extra, None)  # groups from later rounds first, then copies
        if group is None:
            copies += 1
            source = rng.choice(signal)
            group = [replace(tr, uid=f"{tr.uid}#copy{copies}") for tr in source]
        batch.append(group)
    return DynamicSample(_flat(batch), sampled, len(batch), rounds, len(signal) < need)


def step_rows(
    num_rows: int, seed: int, step: int, start: int, count: int, taken: Callable[[int], bool]
) -> list[int]:
    """Dataset row indices `start` to `start + count` of training step `step`'s own seeded
    permutation of the data, leaving out the rows `taken` (already generated this step), so a
    resumed run draws the same prompts and no prompt comes twice in one step; [] once the data is
    used up. The oversampled first round takes rows 0.. of it, extra round r >= 1 the r-th
    `gen_batch_size` rows after the first round."""
    order = list(range(num_rows))
    random.Random(f"{seed}:{step}").shuffle(order)
    return list(itertools.islice((i for i in order if not taken(i)), start, start + count))


def _flat(groups: list[list[Trajectory]]) -> list[Trajectory]:
    return [tr for g in groups for tr in g]


__all__ = ["DynamicSample", "dynamic_sample", "step_rows", "has_signal", "split_groups"]
