"""`trainer.rollout_records.*` (what the run records for `skylift view` and the trackers' sample
tables) and `trainer.policy.torch_profiler_config.*` (SkyRL's key names: torch.profiler traces of
chosen training steps). What they do: `skylift.rl.rollout_records`, `skylift.worker.profiler`."""

from __future__ import annotations

from dataclasses import dataclass

from skylift.config.fields import _f


@dataclass
class RolloutRecordsConfig:
    """Samples recorded during training for `skylift view RUN_DIR` and the trackers' sample tables."""

    interval: int = _f(1, "record every N training steps (and every evaluation); 0 = record nothing", ge=0)
    groups_per_step: int = _f(
        4, "prompt groups recorded per training step (all their samples), the first of the batch", ge=1
    )
    eval_prompts: int = _f(16, "prompts recorded per evaluation (all their samples)", ge=0)
    max_mb: float = _f(
        64.0, "stop recording once <log_dir>/rollouts holds this many MiB (one line says so)", gt=0
    )
    tracker_rows: int = _f(
        8,
        "samples of each recorded step also sent to the trackers as a table (wandb Table, "
        "tensorboard text, mlflow table); 0 = none",
        ge=0,
    )


@dataclass
class TorchProfilerConfig:
    """torch.profiler traces of chosen training steps, one file per traced rank and step."""

    enable: bool = _f(
        False, "trace the policy's training passes of trainer.policy.torch_profiler_config.steps"
    )
    ranks: list[int] = _f([0], "policy ranks that write a trace")
    save_path: str | None = _f(None, "directory of the traces; null = <log_dir>/profiles")
    steps: list[int] = _f([1], "training steps (counted from 1) to trace")
