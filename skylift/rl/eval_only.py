"""Evaluation without training: `skylift eval` (``skylift.entrypoints.main_generate``).

The same configuration as training: the engines serve `trainer.policy.model.path` (a Hugging Face
directory, e.g. an export of a training run) or are the servers of
`generator.remote_inference_engine_urls`; with `checkpoint` (`skylift eval --checkpoint PATH`) they
hold a trainer checkpoint's or an export's weights instead (`skylift.rl.eval_weights`: remote
engines get them by the training run's weight sync). The prompts of `data.val_data` are sampled
with `generator.eval_sampling_params`, `eval_n_samples_per_prompt` times each, and scored by their
environments. The figures are the training loop's evaluation figures (`skylift.rl.evaluation`:
`eval/accuracy` with its standard error, the metrics plugins' figures, e.g. `eval/all/avg_score`,
`eval/<data_source>/avg_score`, `eval/all/pass_at_<n>`, and `timing/eval_generate`), logged once at
step 0 to the run's trackers; `trainer.dump_eval_results` writes each sample
to `<log_dir>/eval/eval_only.jsonl` and the registered dumpers' (`skylift.rl.eval_dumps`; the built-in
one to `<export_path>/dumped_evals/eval_only/`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from skylift.cluster.run_paths import RunPaths
from skylift.cluster.runtime import Runtime
from skylift.config import ConfigError
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptSample
from skylift.rl.eval_dumps import EvalDump, write_eval_dumps
from skylift.rl.eval_weights import export_for_engines, push_to_engines, resolve_eval_weights
from skylift.rl.evaluation import dump_eval, evaluate
from skylift.rl.parts import MetricsLog, RolloutGenerator
from skylift.rl.sampling import Sampler, rollout_seeds, sampling_params
from skylift.utils.eval_stats import format_accuracy
from skylift.utils.loop_thread import LoopThread

DUMP_NAME = "eval_only.jsonl"


def eval_sampler(cfg: SkyliftConfig, generator: RolloutGenerator, loop: LoopThread) -> Sampler:
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
    tracker: MetricsLog,
    logs_dir: Path,
    export_dump: tuple[Path, Callable[[list[int]], str]] | None = None,
) -> dict[str, float]:
    """Evaluate `rows` with `sampler`, log the figures at step 0 and dump the samples if asked:
    to `<logs_dir>/eval/eval_only.jsonl` and, given `export_dump` (the export directory, token ids
    to text), in the registered dumpers' layouts too (`skylift.rl.eval_dumps`)."""
    metrics, trajectories = evaluate(
        list(rows),
        lambda batch: sampler.run(batch, -1),
        cfg.trainer.eval_batch_size,
        cfg.generator.eval_n_samples_per_prompt,
    )
    if cfg.trainer.dump_eval_results:
        dump_eval(logs_dir / "eval" / DUMP_NAME, trajectories)
        if export_dump is not None:
            export_dir, decode = export_dump
            write_eval_dumps(EvalDump(export_dir, None, list(rows), trajectories, metrics, decode))
    tracker.log(metrics, 0)
    return metrics


def summary(metrics: dict[str, float], n: int) -> list[str]:
    """The lines `skylift eval` prints: accuracy with its standard error, then the per-source
    `avg_score` and `pass_at_<n>` figures."""
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
    """Raise `ConfigError` when the configuration cannot be evaluated: no evaluation prompts, or a
    trainer checkpoint given as the model."""
    if not cfg.data.val_data:
        raise ConfigError(
            "skylift eval needs evaluation prompts: set data.val_data to parquet files", key="data.val_data"
        )
    model = Path(cfg.trainer.policy.model.path).expanduser()
    if (model / "policy").is_dir() and (model / "trainer_state.json").is_file():
        raise ConfigError(
            f"trainer.policy.model.path={model} is a trainer checkpoint, not a model: set it to the "
            "run's model and evaluate the checkpoint with --checkpoint",
            key="trainer.policy.model.path",
        )


class EvalOnlyRun:
    """`setup()` starts the engines (or connects to remote ones), `evaluate()` runs the evaluation,
    `shutdown()` takes everything down (the `skylift.rl.run.run_trainer` protocol)."""

    def __init__(
        self,
        cfg: SkyliftConfig,
        say: Callable[[str], None],
        verbose: bool = False,
        checkpoint: str | Path | None = None,
    ) -> None:
        """`checkpoint`: the weights to evaluate (`skylift.rl.eval_weights`: a trainer checkpoint
        or a Hugging Face directory); None: the engines' own (local engines: the model's)."""
        check_eval_config(cfg)
        self.cfg, self.say = cfg, say
        self.weights = resolve_eval_weights(checkpoint, cfg.trainer.policy.model.path) if checkpoint else None
        self.engine_model: Path | None = None  # local engines: the directory they start on
        if self.weights is not None and cfg.generator.run_engines_locally:
            self.engine_model = (
                self.weights.path
                if self.weights.kind == "hf"
                else RunPaths.from_config(cfg).root / "eval_exports" / self.weights.path.name
            )
            cfg = copy.deepcopy(cfg)
            cfg.trainer.policy.model.path = str(self.engine_model)
        self.runtime = Runtime(cfg, say, verbose, eval_only=True)

    def setup(self) -> None:
        weights, rt = self.weights, self.runtime
        if weights is not None:
            self.say(f"evaluating the {weights.describe()}")
        if weights is not None and self.engine_model is not None and weights.kind == "checkpoint":
            self.say(f"converting it for the local engines into {self.engine_model}")
            export_for_engines(self.cfg, weights, self.engine_model)
        rt.start()
        if weights is not None and self.engine_model is None:
            assert rt.engines is not None
            tick = time.perf_counter()
            push_to_engines(self.cfg, weights, rt.engines, rt.run, self.say)
            self.say(f"weights pushed to the engines in {time.perf_counter() - tick:.1f} s")

    def evaluate(self) -> dict[str, float]:
        rt = self.runtime
        assert rt.val_data is not None and rt.generator is not None
        metrics = evaluate_once(
            self.cfg,
            rt.val_data,
            eval_sampler(self.cfg, rt.generator, rt.loop),
            rt.tracking,
            rt.paths.logs,
            (rt.paths.export, rt.tokenizer.decode),
        )
        for line in summary(metrics, self.cfg.generator.eval_n_samples_per_prompt):
            self.say(line)
        self.say(f"figures logged at step 0 to {rt.paths.logs}")
        return metrics

    def shutdown(self) -> None:
        self.runtime.close()
