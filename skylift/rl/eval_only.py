"""Evaluation without training: `skylift eval` (SkyRL's `main_generate`).

The same configuration as training: the engines serve `trainer.policy.model.path` (a Hugging Face
directory, e.g. an export of a training run) or are the servers of
`generator.remote_inference_engine_urls`; the prompts of `data.val_data` are sampled with
`generator.eval_sampling_params`, `eval_n_samples_per_prompt` times each, and scored by their
environments. The figures are the training loop's evaluation figures (`skylift.rl.evaluation`:
skylift's `eval/accuracy` with its standard error, SkyRL's `eval/all/avg_score`,
`eval/<data_source>/avg_score`, `eval/all/pass_at_<n>`), logged once at step 0 to the run's
trackers, as SkyRL logs them; `trainer.dump_eval_results` writes each sample to
`<log_dir>/eval/eval_only.jsonl`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from skylift.cluster.runtime import Runtime
from skylift.config import ConfigError
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptSample
from skylift.rl.evaluation import dump_eval, evaluate
from skylift.rl.parts import RolloutGenerator, Tracker
from skylift.rl.rows import Sampler
from skylift.rl.sampling import rollout_seeds, sampling_params
from skylift.utils.eval_stats import format_accuracy

DUMP_NAME = "eval_only.jsonl"


def eval_sampler(cfg: SkyliftConfig, generator: RolloutGenerator, loop: asyncio.AbstractEventLoop) -> Sampler:
    """The evaluation sampler of a training run's `samplers`, for engines at version 0 (no sync)."""
    return Sampler(
        generator,
        loop,
        cfg.generator.eval_n_samples_per_prompt,
        sampling_params(cfg, True),
        lambda rows, _step: rollout_seeds(cfg, rows, -1),
        lambda: 0,
    )


def evaluate_once(
    cfg: SkyliftConfig,
    rows: Sequence[PromptSample],
    sampler: Sampler,
    tracker: Tracker,
    logs_dir: Path,
) -> dict[str, float]:
    """Evaluate `rows` with `sampler`, log the figures at step 0 and dump the samples if asked."""
    metrics, trajectories = evaluate(
        list(rows),
        lambda batch: sampler.run(batch, -1),
        cfg.trainer.eval_batch_size,
        cfg.generator.eval_n_samples_per_prompt,
    )
    if cfg.trainer.dump_eval_results:
        dump_eval(logs_dir / "eval" / DUMP_NAME, trajectories)
    tracker.log(metrics, 0)
    return metrics


def summary(metrics: dict[str, float], n: int) -> list[str]:
    """The lines `skylift eval` prints: accuracy with its standard error, then SkyRL's figures."""
    if "eval/accuracy" not in metrics:
        return ["no evaluation samples"]
    lines = [
        f"eval accuracy {format_accuracy(metrics['eval/accuracy'], metrics['eval/accuracy_stderr'])}"
        f" | response length {metrics['eval/response_length']:.1f} | {metrics['timing/eval_s']:.1f} s"
    ]
    for key in sorted(metrics):
        if key.endswith(("/avg_score", f"/pass_at_{n}")):
            lines.append(f"{key} {metrics[key]:.4f}")
    return lines


def check_eval_config(cfg: SkyliftConfig) -> None:
    """Raise `ConfigError` when the configuration cannot be evaluated (no evaluation prompts)."""
    if not cfg.data.val_data:
        raise ConfigError(
            "skylift eval needs evaluation prompts: set data.val_data to parquet files", key="data.val_data"
        )


class EvalOnlyRun:
    """`setup()` starts the engines (or connects to remote ones), `evaluate()` runs the evaluation,
    `shutdown()` takes everything down (the `skylift.rl.run.run_trainer` protocol)."""

    def __init__(self, cfg: SkyliftConfig, say: Callable[[str], None], verbose: bool = False) -> None:
        check_eval_config(cfg)
        self.cfg, self.say = cfg, say
        self.runtime = Runtime(cfg, say, verbose, eval_only=True)

    def setup(self) -> None:
        self.runtime.start()

    def evaluate(self) -> dict[str, float]:
        rt = self.runtime
        assert rt.val_data is not None and rt.generator is not None
        metrics = evaluate_once(
            self.cfg, rt.val_data, eval_sampler(self.cfg, rt.generator, rt.loop), rt.tracking, rt.paths.logs
        )
        for line in summary(metrics, self.cfg.generator.eval_n_samples_per_prompt):
            self.say(line)
        self.say(f"figures logged at step 0 to {rt.paths.logs}")
        return metrics

    def shutdown(self) -> None:
        self.runtime.close()
