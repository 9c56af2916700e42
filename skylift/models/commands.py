"""The ``skylift models`` subcommands: ``list`` (what can be prepared, and where) and ``prepare NAME``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from skylift.models.cache import model_dir
from skylift.models.registry import get_spec, is_prepared, list_models, prepare_model


def _dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def run_list(args: argparse.Namespace) -> int:
    """Print a table of registry models: name, approximate size, whether prepared, and where."""
    rows = [("NAME", "SIZE", "PREPARED", "DESCRIPTION / LOCATION")]
    for spec in list_models():
        prepared = is_prepared(spec.name, args.cache_dir)
        location = str(model_dir(spec.name, args.cache_dir))
        rows.append(
            (spec.name, f"~{spec.approx_size_mb:g} MB", "yes" if prepared else "no", spec.description)
        )
        rows.append(("", "", "", location))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    """Prepare one model and print its directory, how long it took and its size on disk."""
    try:
        get_spec(args.name)
    except ValueError as exc:
        raise SystemExit(f"skylift models prepare: {exc}") from None
    start = time.perf_counter()
    path = prepare_model(args.name, force=args.force, cache_dir=args.cache_dir)
    seconds = time.perf_counter() - start
    print(f"{args.name}: {path} ({seconds:.1f} s, {_dir_size_mb(path):.1f} MB)")
    return 0


def add_models_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``models list`` and ``models prepare NAME [--force] [--cache-dir DIR]``.

    Each leaf parser sets ``func`` (taking the parsed namespace, returning an exit code).
    """
    models = subparsers.add_parser("models", help="list and prepare offline models")
    actions = models.add_subparsers(dest="models_command", required=True, metavar="{list,prepare}")

    cache_help = "cache root (default: $SKYLIFT_CACHE_DIR or ~/.cache/skylift)"
    list_parser = actions.add_parser("list", help="show the models skylift can prepare")
    list_parser.add_argument("--cache-dir", default=None, help=cache_help)
    list_parser.set_defaults(func=run_list)

    names = [spec.name for spec in list_models()]
    prepare = actions.add_parser("prepare", help="build a model into the cache (once) and print its path")
    prepare.add_argument("name", metavar="NAME", help=f"one of: {', '.join(names)}")
    prepare.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prepare.add_argument("--cache-dir", default=None, help=cache_help)
    prepare.set_defaults(func=run_prepare)
