"""Train with the RL loop: `python -m skylift.entrypoints.main_base key=value ...` (= `skylift train`).

Every `key.sub=value` override is checked against the typed configuration (unknown keys get a
suggestion). `--config FILE` reads a YAML file first; `--cfg job` prints the resolved tree with
help and exits; `--dry-run` validates, prints the resolved values and exits without starting anything.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.cluster.run_plan import GpuCluster
    from skylift.config import SkyliftConfig
    from skylift.rl.loop import RLTrainer

TRAIN_EPILOG = """\
examples:
  skylift train data.train_data="['~/data/gsm8k/train.parquet']" trainer.policy.model.path=tiny-qwen2
  skylift train generator.run_engines_locally=False \\
      generator.remote_inference_engine_urls="['127.0.0.1:8001']"
  skylift train --cfg job            # print every key with its value and meaning
  skylift train --dry-run trainer.strategy=fsdp ...   # validate a command line, start nothing
  skylift train --dry-run --gpus 8 ...   # what the run would do on one node of 8 80-GiB GPUs
"""


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    parser.add_argument(
        "--config", dest="config_file", default=None, help="YAML file of configuration values"
    )
    parser.add_argument(
        "--cfg", choices=["job"], default=None, help="print the resolved configuration (with help) and exit"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the configuration, print the resolved values (with --gpus: the plan for those GPUs) "
        "and exit without starting anything",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print the libraries' own messages (vLLM, PyTorch, Ray, transformers)",
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """`--gpus`, `--gpu-memory-gib`, `--nodes`: plan the run for GPUs this machine lacks (`--dry-run`)."""
    plan = parser.add_argument_group(
        "planning a GPU run (with --dry-run)",
        "print what the run would do on the GPUs stated, instead of the resolved values: the GPU "
        "defaults it takes, its placement and whether it fits, GPU sharing, colocate_all's memory "
        "split, each engine's weight-sync transport (skylift.cluster.run_plan); exit 2 where the run "
        "would stop",
    )
    plan.add_argument("--gpus", metavar="N", default=None, help="GPUs on each node (a whole number >= 1)")
    plan.add_argument(
        "--gpu-memory-gib", metavar="G", default=None, help="memory of each GPU in GiB (default 80)"
    )
    plan.add_argument("--nodes", metavar="M", default=None, help="nodes (default 1: one machine)")


@dataclass(frozen=True)
class PlanFlags:
    """`--gpus`, `--gpu-memory-gib` and `--nodes` as given (checked by `gpu_cluster`)."""

    gpus: str | None = None
    gpu_memory_gib: str | None = None
    nodes: str | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> PlanFlags:
        return cls(
            getattr(args, "gpus", None), getattr(args, "gpu_memory_gib", None), getattr(args, "nodes", None)
        )

    def given(self) -> bool:
        return any(v is not None for v in (self.gpus, self.gpu_memory_gib, self.nodes))


def gpu_cluster(flags: PlanFlags, dry_run: bool) -> GpuCluster | str:
    """The cluster the flags state, or the one line saying what is wrong with them."""
    from skylift.cluster.run_plan import DEFAULT_GPU_MEMORY_GIB, GpuCluster

    if flags.gpus is None:
        return "--gpu-memory-gib and --nodes describe the GPUs of --gpus N: give --gpus too"
    if not dry_run:
        return "--gpus plans a run without starting it: add --dry-run (a run uses the devices it sees)"

    def number(flag: str, text: str | None, default: float, whole: bool) -> float | str:
        if text is None:
            return default
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = 0
        if not value > 0 or value != value or value == float("inf"):
            kind = "a whole number >= 1" if whole else "a number of GiB > 0"
            return f"{flag} must be {kind}, got {text!r}"
        return value

    gpus = number("--gpus", flags.gpus, 1, True)
    nodes = number("--nodes", flags.nodes, 1, True)
    memory = number("--gpu-memory-gib", flags.gpu_memory_gib, DEFAULT_GPU_MEMORY_GIB, False)
    for value in (gpus, nodes, memory):
        if isinstance(value, str):
            return value
    return GpuCluster(gpus_per_node=int(gpus), nodes=int(nodes), gpu_memory_gib=float(memory))


def log_to_file(log_path: str) -> Path:
    """Also write skylift's log messages (INFO and up) to ``<log_path>/infra-YYMMDD_HHMMSS.log``."""
    path = Path(log_path).expanduser() / time.strftime("infra-%y%m%d_%H%M%S.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("skylift")
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    return path


@dataclass(frozen=True)
class RunOptions:
    """The command line of a run command (`add_train_arguments`)."""

    overrides: Sequence[str] = ()
    config_file: str | None = None
    print_cfg: bool = False  # --cfg job
    verbose: bool = False
    dry_run: bool = False
    plan: PlanFlags = PlanFlags()  # --gpus ...: plan the run for these GPUs (with --dry-run)

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunOptions:
        return cls(
            args.overrides,
            args.config_file,
            args.cfg == "job",
            args.verbose,
            args.dry_run,
            PlanFlags.of(args),
        )


def prepare_run(
    prog: str, run: RunOptions, check: Callable[[SkyliftConfig], None] | None = None
) -> SkyliftConfig | int:
    """What every run command (`skylift train`, `skylift eval`) does before its run: the checked
    configuration (`check`: the command's own checks), or the exit code when the command ends here
    (2 a configuration error, 0 after printing it for `--cfg job` or `--dry-run`). A run also logs
    to `trainer.log_path` and shuts down cleanly on SIGTERM."""
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(run.verbose)  # before vLLM and torch's C++ core print anything
    from skylift.config import ConfigError, format_config, load_config
    from skylift.config.loading import load_config_for

    cluster = gpu_cluster(run.plan, run.dry_run) if run.plan.given() else None
    if isinstance(cluster, str):
        print(f"{prog}: {cluster}", file=sys.stderr)
        return 2
    gpu_defaults: list[str] = []
    try:
        if cluster is not None:  # the run those GPUs would get: their device defaults
            cfg, gpu_defaults = load_config_for(list(run.overrides), run.config_file, cuda=True)
        else:
            cfg = load_config(list(run.overrides), run.config_file)
        if check is not None:
            check(cfg)
        notes = _dry_run_checks(cfg) if run.dry_run else []
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2
    if run.print_cfg:
        print(format_config(cfg, with_help=True))
        return 0
    if run.dry_run:
        if cluster is None:
            print(format_config(cfg))
        from skylift.models import is_missing_local_path

        if is_missing_local_path(path := cfg.trainer.policy.model.path):
            print(
                f"{prog}: note: trainer.policy.model.path={path} names no directory on this machine",
                file=sys.stderr,
            )
        for note in notes:
            print(f"{prog}: note: {note}", file=sys.stderr)
        if cluster is not None:
            from skylift.cluster.run_plan import plan_run

            planned = plan_run(cfg, gpu_defaults, cluster)
            print("\n".join(planned.lines))
            if planned.refusal is not None:
                print(f"{prog}: {planned.refusal}", file=sys.stderr)
                return 2
        print(f"{prog}: dry run: the configuration is valid; nothing was started", file=sys.stderr)
        return 0
    if cfg.trainer.log_path:
        print(f"[skylift] log messages also go to {log_to_file(cfg.trainer.log_path)}")
    from skylift.utils.processes import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm()  # `kill PID` still shuts the engines down
    return cfg


def _dry_run_checks(cfg: SkyliftConfig) -> list[str]:
    """The start-up checks a run makes before anything starts that a dry run can make too
    (`ConfigError` as the run would stop); notes on what it could not check here."""
    from skylift.cluster.routing_run import dry_run_routing_checks

    return dry_run_routing_checks(cfg)


def run_train(run: RunOptions) -> int:
    cfg = prepare_run("skylift", run)
    if isinstance(cfg, int):
        return cfg
    from skylift.rl.build import build_trainer
    from skylift.rl.run import run_trainer

    def fit_and_export(trainer: RLTrainer) -> None:
        trainer.fit()
        print(f"[skylift] exported Hugging Face weights to {trainer.export()}")

    return run_trainer(
        lambda: build_trainer(cfg, verbose=run.verbose), fit_and_export, "skylift", run.verbose
    )


def parse_run_arguments(
    prog: str, description: str | None, epilog: str, argv: Sequence[str] | None
) -> RunOptions:
    """The command line of a run entry point (`skylift train`, `skylift eval`): overrides and flags."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    add_plan_arguments(parser)
    return RunOptions.of(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    return run_train(parse_run_arguments("skylift train", __doc__, TRAIN_EPILOG, argv))


if __name__ == "__main__":
    sys.exit(main())
