"""CLI subcommands of the trainer: `skylift train`, `skylift eval`, `skylift config`, `skylift plot`."""

from __future__ import annotations

import argparse

from skylift.entrypoints.main_base import (
    TRAIN_EPILOG,
    RunOptions,
    add_plan_arguments,
    add_train_arguments,
    run_train,
)
from skylift.entrypoints.main_generate import add_eval_command


def _train(args: argparse.Namespace) -> int:
    return run_train(RunOptions.of(args))


def _config(args: argparse.Namespace) -> int:
    return run_train(RunOptions(args.overrides, args.config_file, print_cfg=True))


def _plot(args: argparse.Namespace) -> int:
    from skylift.tracking.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def add_trainer_commands(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        help="RL training (GRPO, RLOO, ...) with local or remote engines",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(train)
    add_plan_arguments(train)
    train.set_defaults(func=_train)
    add_eval_command(sub)

    config = sub.add_parser("config", help="print the training configuration tree with defaults and help")
    config.add_argument("overrides", nargs="*", metavar="key.sub=value")
    config.add_argument(
        "--config", dest="config_file", default=None, help="YAML file of configuration values"
    )
    config.set_defaults(func=_config)

    plot = sub.add_parser("plot", help="PNG of reward and eval accuracy per step of a run")
    plot.add_argument("run_dir", help="run directory (holding logs/metrics.jsonl) or its logs directory")
    plot.add_argument("--out", default=None, help="output PNG (default: next to metrics.jsonl)")
    plot.set_defaults(func=_plot)
