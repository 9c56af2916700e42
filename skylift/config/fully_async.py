"""`trainer.fully_async.*`: fully asynchronous training with in-flight weight updates.

The seed's key names (`max_staleness_steps`, `num_parallel_generation_workers`) plus `enabled` and
`pause_mode`; what they do is described in `skylift.rl.fully_async`.
"""

from __future__ import annotations

from dataclasses import dataclass

from skylift.config.fields import _f

PAUSE_MODES = ("keep", "abort")


@dataclass
class FullyAsyncConfig:
    """Generation never waits for training: rollouts stream into a bounded buffer."""

    enabled: bool = _f(
        False,
        "fully async: rollouts are generated continuously into a bounded buffer, the trainer takes a "
        "batch when one is ready, and every weight sync pauses the engines with requests in flight "
        "(needs a correction of the off-policy gap: trainer.algorithm.use_tis, an "
        "off_policy_correction, or policy_loss_type=rollout_is or dppo)",
    )
    max_staleness_steps: int = _f(
        4,
        "most policy updates between the oldest token of a rollout and the update that trains on it; "
        "a group that would be older is dropped and its prompt sampled again",
        ge=0,
    )
    num_parallel_generation_workers: int | None = _f(
        None,
        "prompt groups generated concurrently, between train_batch_size and train_batch_size * "
        "(max_staleness_steps + 1); null = train_batch_size",
        ge=1,
    )
    sample_full_batch: bool = _f(
        False,
        "drop the prompt groups whose rewards are all equal as they finish (their prompts count as "
        "used; the slot is given back) until a batch of groups with a signal is ready: DAPO's "
        "dynamic-sampling filter, fully async. Needs trainer.algorithm.zero_variance_filter=true. "
        "When the data runs out mid batch, the partial batch is discarded and the run ends",
    )
    pause_mode: str = _f(
        "keep",
        f"{' | '.join(PAUSE_MODES)}: what a weight sync does to requests in flight: keep = vLLM freezes "
        "them and they continue with the new weights; abort = they end and are resubmitted (prompt "
        "plus the tokens sampled so far)",
        choices=PAUSE_MODES,
    )
