"""Evaluation dumps in other projects' layouts, written beside skylift's own.

With ``trainer.dump_eval_results`` the training loop and ``skylift eval`` write skylift's dump
(`skylift.rl.evaluation.dump_eval`) and hand each evaluation to the dumpers of `EVAL_DUMPERS`:
the built-in dumper's module is named here and imported by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.utils.hooks import Hook


@dataclass(frozen=True)
class EvalDump:
    """One evaluation's samples and figures, for a dumper."""

    export_dir: Path  # the run's export path (trainer.export_path)
    global_step: int | None  # None: an eval-only run
    rows: Sequence[PromptSample]  # the evaluated prompts (their env class and extras, by uid)
    trajectories: Sequence[Trajectory]
    metrics: Mapping[str, float]
    decode: Callable[[list[int]], str]  # token ids to text (the run's tokenizer)


EVAL_DUMPERS: Hook[Callable[[EvalDump], object]] = Hook(
    "evaluation dumper", ("skylift.compat.skyrl.eval_dump",)
)


def write_eval_dumps(dump: EvalDump) -> None:
    """Hand `dump` to every registered dumper."""
    for dumper in EVAL_DUMPERS.items():
        dumper(dump)
