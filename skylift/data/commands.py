"""The ``skylift data`` subcommands: ``data gsm8k`` and ``data synthetic``.

``add_data_command(subparsers)`` registers them on the CLI's subparsers; each leaf parser sets
``func`` (``args.func(args) -> int``, the exit status).
"""

from __future__ import annotations

import argparse
import sys

from skylift.data.gsm8k import BadRowsError, GSM8KSourceError, prepare_gsm8k
from skylift.data.schema import PreparedDataset
from skylift.data.synthetic import DEMO_NUM_HELDOUT, write_addition_demo, write_arithmetic_dataset

SYNTHETIC_TASKS = ("arithmetic", "addition-demo")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_data_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``data gsm8k`` and ``data synthetic`` on `subparsers`."""
    data = subparsers.add_parser("data", help="prepare prompt datasets (parquet)")
    data_sub = data.add_subparsers(dest="data_command", metavar="{gsm8k,synthetic}", required=True)

    gsm8k = data_sub.add_parser(
        "gsm8k",
        help="GSM8K -> train.parquet and validation.parquet (the test split)",
        description="Write GSM8K as prompt parquet files (skylift.data.schema's columns). Without --local-path the "
        "Hugging Face dataset openai/gsm8k is downloaded (needs `datasets` and network).",
    )
    gsm8k.add_argument("--out", required=True, help="output folder")
    gsm8k.add_argument("--local-path", default=None, help="folder with train.jsonl and test.jsonl")
    gsm8k.add_argument("--max-train", type=_non_negative_int, default=None, help="first N train rows only")
    gsm8k.add_argument("--max-val", type=_non_negative_int, default=None, help="first N test rows only")
    gsm8k.add_argument("--strict", action="store_true", help="fail on any bad row instead of skipping it")
    gsm8k.set_defaults(func=run_gsm8k)

    synthetic = data_sub.add_parser(
        "synthetic",
        help="synthetic arithmetic tasks in GSM8K's '#### answer' format",
        description="arithmetic: multi-step chains; addition-demo: the `skylift demo` task "
        f"(A + B, A and B in [0, 99], {DEMO_NUM_HELDOUT} held-out problems by default).",
    )
    synthetic.add_argument("--task", choices=SYNTHETIC_TASKS, required=True)
    synthetic.add_argument("--out", required=True, help="output folder")
    synthetic.add_argument("--num-train", type=_non_negative_int, default=1000)
    synthetic.add_argument(
        "--num-val", type=_non_negative_int, default=None, help=f"default {DEMO_NUM_HELDOUT}"
    )
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.set_defaults(func=run_synthetic)


def _report(result: PreparedDataset) -> None:
    print(result.summary())


def run_gsm8k(args: argparse.Namespace) -> int:
    """``skylift data gsm8k``: returns 0 on success, 1 on a source error or strict failure."""
    try:
        result = prepare_gsm8k(
            args.out, args.local_path, max_train=args.max_train, max_val=args.max_val, strict=args.strict
        )
    except (GSM8KSourceError, BadRowsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _report(result)
    return 0


def run_synthetic(args: argparse.Namespace) -> int:
    """``skylift data synthetic``: returns 0 on success, 1 on an invalid size."""
    num_val = DEMO_NUM_HELDOUT if args.num_val is None else args.num_val
    try:
        if args.task == "arithmetic":
            result = write_arithmetic_dataset(args.out, args.num_train, num_val, args.seed)
        else:
            result = write_addition_demo(args.out, args.num_train, num_val, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _report(result)
    return 0
