"""Evaluate without training: `python -m skylift.entrypoints.main_generate key=value ...`
(= `skylift eval`; the seed's module name for evaluation without training).

The configuration is training's (the same keys, files and compatible key names); the engines serve
`trainer.policy.model.path` (a Hugging Face directory, e.g. `<export_path>/global_step_N` of a
training run) or are the servers of `generator.remote_inference_engine_urls`; `--checkpoint PATH`
evaluates a trainer checkpoint (`<ckpt_path>/global_step_N`) or an export instead, pushed to remote
engines by weight sync. The prompts of
`data.val_data` are sampled with `generator.eval_sampling_params`, `eval_n_samples_per_prompt`
times each; the evaluation figures (skylift's and the metrics plugins') are printed and logged at step 0
(`skylift.rl.eval_only`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from skylift.entrypoints.main_base import RunOptions, add_train_arguments, prepare_run

if TYPE_CHECKING:
    from skylift.config import SkyliftConfig

EVAL_EPILOG = """\
examples:
  skylift eval data.val_data="['~/data/gsm8k/validation.parquet']" \\
      trainer.policy.model.path=~/skylift_runs/my_run/exports/global_step_20
  skylift eval generator.run_engines_locally=False \\
      generator.remote_inference_engine_urls="['127.0.0.1:8001']" generator.eval_n_samples_per_prompt=4
  skylift eval --checkpoint ~/skylift_runs/my_run/ckpts/global_step_20 \\
      data.val_data="['~/data/gsm8k/validation.parquet']" trainer.policy.model.path=Qwen/Qwen2.5-0.5B-Instruct
"""


def _check_eval_config(cfg: SkyliftConfig, checkpoint: str | None) -> None:
    from skylift.rl.eval_only import check_eval_config  # after prepare_run quieted the libraries
    from skylift.rl.eval_weights import resolve_eval_weights

    check_eval_config(cfg)
    if checkpoint:  # a path that is neither kind, or of another model: refused before anything starts
        resolve_eval_weights(checkpoint, cfg.trainer.policy.model.path)


def run_eval(run: RunOptions, checkpoint: str | None = None) -> int:
    """`skylift eval`; `checkpoint`: `--checkpoint PATH` (see `skylift.rl.eval_weights`)."""
    cfg = prepare_run("skylift eval", run, lambda c: _check_eval_config(c, checkpoint))
    if isinstance(cfg, int):
        return cfg
    from skylift.rl.console import Console
    from skylift.rl.eval_only import EvalOnlyRun
    from skylift.rl.run import run_trainer

    say = Console(True).say
    return run_trainer(
        lambda: EvalOnlyRun(cfg, say, run.verbose, checkpoint),
        EvalOnlyRun.evaluate,
        "skylift eval",
        run.verbose,
    )


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """`skylift train`'s arguments and `--checkpoint PATH`."""
    add_train_arguments(parser)
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="evaluate these weights: a trainer checkpoint (<ckpt_path>/global_step_N, or <ckpt_path> "
        "for its latest) loaded over trainer.policy.model.path, or a Hugging Face directory (e.g. "
        "<export_path>/global_step_N); remote engines receive them by weight sync",
    )


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluate a model on data.val_data without training (also: python -m skylift.entrypoints.main_generate)",
        description=__doc__,
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_eval_arguments(parser)
    parser.set_defaults(func=lambda args: run_eval(RunOptions.of(args), args.checkpoint))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skylift eval",
        description=__doc__,
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_eval_arguments(parser)
    args = parser.parse_args(argv)
    return run_eval(RunOptions.of(args), args.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
