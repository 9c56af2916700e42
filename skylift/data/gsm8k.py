"""GSM8K preparation: jsonl (or the Hugging Face dataset) -> prompt parquet files (`skylift.data.schema`).

Output, in ``out_dir``: ``train.parquet`` (GSM8K train split) and ``validation.parquet`` (GSM8K test
split), one row per problem (schema in `skylift.data.schema`)::

    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": <question> + " " + GSM8K_INSTRUCTION}]
    env_class    "gsm8k"
    reward_spec  {"method": "rule", "ground_truth": "72"}
    extra_info   {"split", "index", "question", "answer"}   (index: 0-based row in the source split)

Rows that cannot be graded (no answer, no ``####``, a non-number after it, no question, bad JSON)
are skipped and reported with their split and index; with ``strict=True`` they are an error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from skylift.data.schema import BadRow, PreparedDataset, make_row, write_prompt_parquet
from skylift.envs.rewards import ANSWER_MARKER, normalize_number

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_HF_CONFIG = "main"
GSM8K_ENV_CLASS = "gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
#: output file stem -> GSM8K source split
GSM8K_SPLITS: dict[str, str] = {"train": "train", "validation": "test"}

# (index in the source split, the record or None, why the record could not be read)
SourceRecord = tuple[int, Mapping[str, Any] | None, str | None]


class GSM8KSourceError(RuntimeError):
    """GSM8K could not be read from the requested source."""


class BadRowsError(ValueError):
    """Strict preparation found rows that cannot be graded; `bad_rows` lists them."""

    def __init__(self, bad_rows: list[BadRow]) -> None:
        self.bad_rows = bad_rows
        shown = "; ".join(str(b) for b in bad_rows[:10])
        more = f" (and {len(bad_rows) - 10} more)" if len(bad_rows) > 10 else ""
        super().__init__(f"{len(bad_rows)} bad GSM8K row(s) in strict mode: {shown}{more}")


def gsm8k_prompt(question: str) -> list[dict[str, str]]:
    """The chat prompt of one GSM8K problem: the question followed by the answer-format instruction."""
    return [{"role": "user", "content": f"{question.strip()} {GSM8K_INSTRUCTION}"}]


def parse_gsm8k_answer(answer: Any) -> str:
    """The ground truth of a GSM8K solution text (the number after its last ``####``, with ``,`` and
    ``$`` removed). Raises ValueError saying what is wrong."""
    if answer is None:
        raise ValueError("missing answer")
    if not isinstance(answer, str):
        raise ValueError(f"answer is a {type(answer).__name__}, not a string")
    if not answer.strip():
        raise ValueError("empty answer")
    if ANSWER_MARKER not in answer:
        raise ValueError(f"answer has no {ANSWER_MARKER!r}")
    tail = answer.rsplit(ANSWER_MARKER, 1)[1].strip()
    number = normalize_number(tail)
    if number is None:
        raise ValueError(f"cannot parse a number after {ANSWER_MARKER!r}: {tail[:40]!r}")
    return number


def gsm8k_row(record: Mapping[str, Any], split: str, index: int) -> dict[str, Any]:
    """The prompt row of one GSM8K record ``{"question", "answer"}``; raises ValueError if bad."""
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing question")
    answer = record.get("answer")
    ground_truth = parse_gsm8k_answer(answer)
    return make_row(
        data_source=GSM8K_DATA_SOURCE,
        prompt=gsm8k_prompt(question),
        env_class=GSM8K_ENV_CLASS,
        ground_truth=ground_truth,
        extra_info={"split": split, "index": index, "question": question, "answer": answer},
    )


def read_jsonl_records(path: Path) -> Iterator[SourceRecord]:
    """Records of a jsonl file; blank lines are skipped but still count for the index (the index is
    the 0-based line number)."""
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield index, None, f"invalid JSON ({e.msg})"
                continue
            if not isinstance(record, dict):
                yield index, None, f"a JSON {type(record).__name__}, not an object"
                continue
            yield index, record, None


def _local_split(local_path: Path, source_split: str) -> Iterator[SourceRecord]:
    path = local_path / f"{source_split}.jsonl"
    if not path.is_file():
        raise GSM8KSourceError(
            f"GSM8K file not found: {path} (--local-path must be a folder with train.jsonl and test.jsonl)"
        )
    return read_jsonl_records(path)


def _hub_splits() -> dict[str, Any]:
    try:
        import datasets  # optional: only the online path needs it
    except ImportError:
        raise GSM8KSourceError(
            "loading GSM8K from the Hugging Face hub needs the `datasets` package, which is not "
            "installed; `pip install datasets`, or pass --local-path DIR (a folder with train.jsonl "
            "and test.jsonl)"
        ) from None
    try:
        return datasets.load_dataset(GSM8K_DATA_SOURCE, GSM8K_HF_CONFIG)
    except Exception as e:  # network, offline mode, missing cache...
        raise GSM8KSourceError(
            f"could not load {GSM8K_DATA_SOURCE} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "if this machine is offline, pass --local-path DIR (a folder with train.jsonl and test.jsonl)"
        ) from e


def _hub_split(hub: Any, source_split: str) -> Iterator[SourceRecord]:
    for index, record in enumerate(hub[source_split]):
        yield index, record, None


def prepare_gsm8k(
    out_dir: str | Path,
    local_path: str | Path | None = None,
    *,
    max_train: int | None = None,
    max_val: int | None = None,
    strict: bool = False,
) -> PreparedDataset:
    """Write ``train.parquet`` and ``validation.parquet`` for GSM8K into `out_dir`.

    local_path: a folder with ``train.jsonl`` and ``test.jsonl``; None loads ``openai/gsm8k`` from
        the Hugging Face hub (needs `datasets` and network).
    max_train / max_val: read only the first N rows of the source train / test split.
    strict: raise `BadRowsError` (and write nothing) if any row read is bad; otherwise bad rows are
        skipped, logged as a warning and returned in ``PreparedDataset.bad_rows``.
    """
    start = time.perf_counter()
    for name, value in (("max_train", max_train), ("max_val", max_val)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    out_dir = Path(out_dir)
    if local_path is not None:
        local = Path(local_path)
        if not local.is_dir():
            raise GSM8KSourceError(
                f"--local-path {local} is not a folder (expected train.jsonl and test.jsonl)"
            )
        source = str(local)
        splits = {out: _local_split(local, src) for out, src in GSM8K_SPLITS.items()}
    else:
        hub = _hub_splits()
        source = f"hf:{GSM8K_DATA_SOURCE}"
        splits = {out: _hub_split(hub, src) for out, src in GSM8K_SPLITS.items()}

    limits = {"train": max_train, "validation": max_val}
    rows: dict[str, list[dict[str, Any]]] = {}
    bad_rows: list[BadRow] = []
    for out_split, records in splits.items():
        source_split = GSM8K_SPLITS[out_split]
        rows[out_split] = []
        limit = limits[out_split]
        for count, (index, record, error) in enumerate(records):
            if limit is not None and count >= limit:
                break
            if record is None:
                bad_rows.append(BadRow(source_split, index, error or "unreadable row"))
                continue
            try:
                rows[out_split].append(gsm8k_row(record, source_split, index))
            except ValueError as e:
                bad_rows.append(BadRow(source_split, index, str(e)))

    if bad_rows and strict:
        raise BadRowsError(bad_rows)

    result = PreparedDataset(out_dir=out_dir, source=source, bad_rows=bad_rows)
    for out_split, split_rows in rows.items():
        result.files[out_split] = write_prompt_parquet(split_rows, out_dir / f"{out_split}.parquet")
        result.num_rows[out_split] = len(split_rows)
    result.seconds = time.perf_counter() - start
    if bad_rows:
        shown = "; ".join(str(b) for b in bad_rows[:10])
        more = f" (and {len(bad_rows) - 10} more)" if len(bad_rows) > 10 else ""
        logger.warning("GSM8K: skipped %d bad row(s): %s%s", len(bad_rows), shown, more)
    return result
