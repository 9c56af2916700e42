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
    logprob_interval: int = _f(
        10,
        "a step with one on-policy update computes no trainer logprobs before it: every N-th such "
        "recorded step (1, N+1, ...) gets a forward pass of its recorded rows for the per-token "
        "trainer-vs-engine gap; 0 = never (steps with the trainer's logprobs always have it)",
        ge=0,
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


PROFILER_ACTIVITIES = ("cpu", "cuda")
PROFILER_EXPORTS = ("chrome_trace", "stacks")


@dataclass
class TorchProfilerConfig:
    """torch.profiler traces of the policy workers (SkyRL's keys; skylift.worker.profiler). One
    profiler step is one training step: `torch.profiler.schedule(skip_first, wait, warmup, active,
    repeat)` picks the traced ones, counted from step 1 of the run."""

    enable: bool = _f(False, "trace the policy workers' training steps the schedule below picks")
    ranks: list[int] = _f([0], "policy ranks that write a trace")
    save_path: str | None = _f(None, "directory of the traces; null = <log_dir>/profiles")
    skip_first: int = _f(10, "training steps before the schedule starts (torch.profiler.schedule)", ge=0)
    wait: int = _f(0, "steps waited at the start of each cycle", ge=0)
    warmup: int = _f(1, "steps of warm-up (traced, discarded) in each cycle", ge=0)
    active: int = _f(1, "steps traced in each cycle (one trace file per cycle)", ge=1)
    repeat: int = _f(1, "cycles; 0 = until the run ends", ge=0)
    activities: list[str] = _f(
        ["cpu", "cuda"],
        "what is traced: cpu, cuda (cuda only where the worker has a GPU)",
        choices=PROFILER_ACTIVITIES,
    )
    record_shapes: bool = _f(True, "record operator input shapes")
    profile_memory: bool = _f(False, "record tensor memory allocations")
    with_stack: bool = _f(True, "record Python stacks (needed by export_type=stacks)")
    with_flops: bool = _f(False, "estimate FLOPs of matrix products and convolutions")
    with_modules: bool = _f(False, "record the nn.Module hierarchy of each operator")
    use_gzip: bool = _f(False, "gzip the chrome traces (*.pt.trace.json.gz)")
    export_type: str = _f(
        "chrome_trace",
        "chrome_trace (rank_<r>_step_<n>.pt.trace.json per cycle) | stacks (rank_<r>_stacks.txt: "
        "self time per stack, for flame graphs)",
        choices=PROFILER_EXPORTS,
    )
