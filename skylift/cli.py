"""The `skylift` command: one entry point, one subcommand per job.

Subcommands import their modules lazily so `skylift --help` stays fast (vLLM and Ray take
seconds to import).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _run_demo(args: argparse.Namespace) -> int:
    if args.task == "sft-rl":
        from skylift.demo_pipeline import run_pipeline_demo

        return run_pipeline_demo(args.overrides, args.verbose)
    from skylift.demo import run_demo

    return run_demo(args.overrides, args.verbose, args.task, args.worked_example)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skylift",
        description="RL post-training for language models: vLLM engines, GRPO trainer, Tinker service.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from skylift.models.commands import add_models_command

    add_models_command(sub)

    from skylift.data.commands import add_data_command

    add_data_command(sub)

    from skylift.tinker.commands import add_tinker_command

    add_tinker_command(sub)

    from skylift.entrypoints.commands import add_trainer_commands

    add_trainer_commands(sub)

    from skylift.viewer.commands import add_view_command

    add_view_command(sub)

    from skylift.supervised.commands import add_sft_command

    add_sft_command(sub)

    demo = sub.add_parser(
        "demo",
        help="GRPO demo: SmolLM2-135M learns two-digit addition (or, --task tools, to use a calculator) on CPU",
    )
    from skylift.demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_run_demo)

    sub.add_parser(
        "serve",
        help="run the vLLM inference server with skylift's control routes (all vLLM server flags)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `skylift serve ...` hands every remaining flag to vLLM's own argument parser.
    if args_list and args_list[0] == "serve":
        from skylift.inference.server import main as serve_main

        return serve_main(args_list[1:]) or 0

    if args_list and args_list[0] in ("train", "eval", "demo", "sft"):
        from skylift.utils.quiet import quiet_libraries

        quiet_libraries("--verbose" in args_list)  # before the parsers below import torch
    parser = _build_parser()
    args = parser.parse_args(args_list)
    if args.version:
        from skylift import __version__

        print(__version__)
        return 0
    handler = getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
