"""The prompt-dataset schema shared by every dataset writer and by `PromptDataset`.

One row is one prompt, with the columns of the seed's prompt datasets (which load unchanged):

- ``data_source`` (str, optional): where the prompt comes from, e.g. ``"openai/gsm8k"`` (empty when
  absent, as in SkyRL's geometry3k and visgym datasets).
- ``prompt`` (list of ``{role, content}``): the chat messages given to the policy.
- ``env_class`` (str): the registered environment that scores the response (see `skylift.envs`).
- ``reward_spec`` (struct ``{method, ground_truth}``, optional): ``method`` is ``"rule"`` for rule-based
  rewards; ``ground_truth`` is the reference answer as a string.
- ``extra_info`` (struct, optional): free per-dataset fields; every writer here sets at least
  ``split``, ``index``, ``question`` and ``answer``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS: tuple[str, ...] = ("prompt", "env_class")
#: columns a row may leave out (empty when absent), as the seed's mini-SWE-agent rows do: their
#: task is an ``instance`` column, which reaches the environment among the row's other columns;
#: SkyRL's vision-language datasets (geometry3k, visgym) have no ``data_source``
OPTIONAL_COLUMNS: tuple[str, ...] = ("data_source", "reward_spec", "extra_info")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_SPEC_TYPE = pa.struct([("method", pa.string()), ("ground_truth", pa.string())])

#: extra_info fields every writer in this package sets, in this order.
BASE_EXTRA_INFO_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("split", pa.string()),
    ("index", pa.int64()),
    ("question", pa.string()),
    ("answer", pa.string()),
)


def prompt_schema(extra_info_fields: Sequence[tuple[str, pa.DataType]] = ()) -> pa.Schema:
    """The Arrow schema of a prompt file; `extra_info_fields` are appended to the base extra_info."""
    extra = pa.struct(list(BASE_EXTRA_INFO_FIELDS) + list(extra_info_fields))
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(MESSAGE_TYPE)),
            ("env_class", pa.string()),
            ("reward_spec", REWARD_SPEC_TYPE),
            ("extra_info", extra),
        ]
    )


def make_row(
    *,
    data_source: str,
    prompt: list[dict[str, str]],
    env_class: str,
    ground_truth: str,
    extra_info: Mapping[str, Any],
    method: str = "rule",
) -> dict[str, Any]:
    """One row of a prompt file as a plain dict (the shape `write_prompt_parquet` takes)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
        "env_class": env_class,
        "reward_spec": {"method": method, "ground_truth": ground_truth},
        "extra_info": dict(extra_info),
    }


def write_prompt_parquet(
    rows: Iterable[Mapping[str, Any]],
    path: str | Path,
    extra_info_fields: Sequence[tuple[str, pa.DataType]] = (),
) -> Path:
    """Write prompt rows to `path` (parent folders are created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows), schema=prompt_schema(extra_info_fields))
    pq.write_table(table, path)
    return path


@dataclass(frozen=True)
class BadRow:
    """A source row that could not be turned into a prompt: its split, index and why."""

    split: str
    index: int
    reason: str

    def __str__(self) -> str:
        return f"{self.split}[{self.index}]: {self.reason}"


@dataclass
class PreparedDataset:
    """What a dataset writer produced: the files per split, their row counts and rejected rows."""

    out_dir: Path
    source: str
    files: dict[str, Path] = field(default_factory=dict)
    num_rows: dict[str, int] = field(default_factory=dict)
    bad_rows: list[BadRow] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        """A one-paragraph human summary (files, counts, rejected rows)."""
        lines = [f"source: {self.source}"]
        for split, path in self.files.items():
            lines.append(f"  {split}: {self.num_rows.get(split, 0)} rows -> {path}")
        if self.bad_rows:
            lines.append(f"  skipped {len(self.bad_rows)} bad row(s):")
            lines.extend(f"    {bad}" for bad in self.bad_rows[:20])
            if len(self.bad_rows) > 20:
                lines.append(f"    ... and {len(self.bad_rows) - 20} more")
        lines.append(f"  took {self.seconds:.2f} s")
        return "\n".join(lines)
