"""The `skylift view RUN_DIR [--serve [--port N]]` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_view_command(sub: Any) -> None:
    view = sub.add_parser(
        "view",
        help="write an HTML report of a run's recorded rollouts (prompts, conversations, rewards, "
        "per-token logprob gaps, evaluations, step times) into RUN_DIR/viewer",
    )
    view.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run's folder (<runs_dir>/<run_name>) or its log_dir"
    )
    view.add_argument("--serve", action="store_true", help="also serve the report on 127.0.0.1 until Ctrl-C")
    view.add_argument("--port", type=int, default=8765, help="port of --serve (0: any free port)")
    view.set_defaults(func=run_view)


def run_view(args: argparse.Namespace) -> int:
    from skylift.viewer.report import NoRecordsError, build_report

    try:
        index = build_report(Path(args.run_dir))
    except NoRecordsError as exc:
        print(f"skylift view: {exc}", file=sys.stderr)
        return 2
    print(index)
    if args.serve:
        from skylift.viewer.serve import serve_folder

        try:
            serve_folder(index.parent, args.port)
        except OSError as exc:  # the port is taken, or not ours to open
            print(
                f"skylift view: cannot serve on 127.0.0.1:{args.port}: {exc.strerror or exc}", file=sys.stderr
            )
            return 2
    return 0
