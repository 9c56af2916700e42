"""Evaluation samples dumped as SkyRL's `dump_eval_results` writes them, beside skylift's own dump.

SkyRL (`trainer_utils.dump_per_dataset_eval_results`) writes, with `trainer.dump_eval_results`,
into `<export_path>/dumped_evals/global_step_<N>_evals/` (training) or `.../eval_only/`
(`main_generate`): one `<data_source>.jsonl` per data source (`/` -> `_`, none -> `unknown`), a
line per sample with `input_prompt`, `output_response`, `score`, `stop_reason`, `env_class`,
`env_extras`, `data_source`; and `aggregated_results.jsonl`, one line holding the evaluation's
`eval/*` figures. Scripts written for SkyRL's dumps read these unchanged.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skylift.compat.skyrl.metrics import skyrl_source_name
from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.rl.eval_dumps import EVAL_DUMPERS, EvalDump

AGGREGATED = "aggregated_results.jsonl"


def skyrl_dump_dir(export_dir: Path, global_step: int | None) -> Path:
    """SkyRL's directory of one evaluation's dump (None: an eval-only run)."""
    return (
        export_dir
        / "dumped_evals"
        / ("eval_only" if global_step is None else f"global_step_{global_step}_evals")
    )


def dump_skyrl_eval(
    directory: Path,
    rows: Sequence[PromptSample],
    trajectories: Sequence[Trajectory],
    metrics: Mapping[str, float],
    decode: Callable[[list[int]], str],
) -> list[Path]:
    """Write SkyRL's per-data-source files and `aggregated_results.jsonl` into `directory`;
    `rows`: the evaluated prompts (their env class and extras, by uid); `decode`: token ids to
    text (the run's tokenizer). Returns the files written."""
    by_uid = {row.uid: row for row in rows}
    per_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for tr in trajectories:
        row = by_uid.get(tr.uid)
        source = tr.data_source or "unknown"
        per_source[source].append(
            {
                "input_prompt": decode(tr.prompt_ids),
                "output_response": decode(tr.response_ids),
                "score": tr.reward,
                "stop_reason": tr.stop_reason,
                "env_class": row.env_class if row is not None else None,
                "env_extras": row.env_extras() if row is not None else {},
                "data_source": source,
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for source, entries in per_source.items():
        path = directory / f"{skyrl_source_name(source)}.jsonl"
        path.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
        written.append(path)
    aggregated = {k: v for k, v in metrics.items() if k.startswith("eval/")}
    (directory / AGGREGATED).write_text(json.dumps(aggregated, ensure_ascii=False) + "\n")
    return [*written, directory / AGGREGATED]


@EVAL_DUMPERS.register
def dump(evaluation: EvalDump) -> list[Path]:
    """The dumper `skylift.rl.eval_dumps` calls: SkyRL's layout under the export path."""
    directory = skyrl_dump_dir(evaluation.export_dir, evaluation.global_step)
    return dump_skyrl_eval(
        directory, evaluation.rows, evaluation.trajectories, evaluation.metrics, evaluation.decode
    )
