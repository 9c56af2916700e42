"""Evaluate without training: `python -m skylift.entrypoints.main_generate key=value ...`
(= `skylift eval`; SkyRL's `main_generate`).

The configuration is training's (the same keys, files and SkyRL spellings); the engines serve
`trainer.policy.model.path` (a Hugging Face directory, e.g. `<export_path>/global_step_N` of a
training run) or are the servers of `generator.remote_inference_engine_urls`. The prompts of
`data.val_data` are sampled with `generator.eval_sampling_params`, `eval_n_samples_per_prompt`
times each; skylift's and SkyRL's evaluation figures are printed and logged at step 0
(`skylift.rl.eval_only`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from skylift.entrypoints.main_base import add_train_arguments, log_to_file, parse_run_arguments

EVAL_EPILOG = """\
examples:
  skylift eval data.val_data="['~/data/gsm8k/validation.parquet']" \\
      trainer.policy.model.path=~/skylift_runs/my_run/exports/global_step_20
  skylift eval generator.run_engines_locally=False \\
      generator.remote_inference_engine_urls="['127.0.0.1:8001']" generator.eval_n_samples_per_prompt=4
"""


def run_eval(
    overrides: Sequence[str],
    config_file: str | None = None,
    print_cfg: bool = False,
    verbose: bool = False,
    dry_run: bool = False,
) -> int:
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(verbose)
    from skylift.config import ConfigError, format_config, load_config
    from skylift.rl.eval_only import check_eval_config

    try:
        cfg = load_config(list(overrides), config_file)
        check_eval_config(cfg)
    except ConfigError as exc:
        print(f"skylift eval: configuration error: {exc}", file=sys.stderr)
        return 2
    if print_cfg or dry_run:
        print(format_config(cfg, with_help=print_cfg))
        if dry_run:
            print("skylift eval: dry run: the configuration is valid; nothing was started", file=sys.stderr)
        return 0
    if cfg.trainer.log_path:
        print(f"[skylift] log messages also go to {log_to_file(cfg.trainer.log_path)}")
    from skylift.rl.console import Console
    from skylift.rl.eval_only import EvalOnlyRun
    from skylift.rl.run import run_trainer
    from skylift.utils.processes import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm()
    say = Console(True).say
    return run_trainer(lambda: EvalOnlyRun(cfg, say, verbose), EvalOnlyRun.evaluate, "skylift eval")


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluate a model on data.val_data without training (SkyRL's main_generate)",
        description=__doc__,
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    parser.set_defaults(
        func=lambda a: run_eval(a.overrides, a.config_file, a.cfg == "job", a.verbose, a.dry_run)
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_run_arguments("skylift eval", __doc__, EVAL_EPILOG, argv)
    return run_eval(args.overrides, args.config_file, args.cfg == "job", args.verbose, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
