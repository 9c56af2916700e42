"""Chat datasets for supervised training: rows of ``messages`` (with optional ``tools``), or
``prompt``/``completion`` columns, as Hugging Face, TRL and SkyRL write them (and Alpaca's
``instruction``/``input``/``output``, which SkyRL's examples train on).

A source is a local ``.jsonl``, ``.json`` or ``.parquet`` file (or a directory of them), or a Hub
dataset name read with `datasets.load_dataset(name, split=...)` when the run starts (never when a
command line is checked). Each row becomes a `ChatExample`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class ChatDataError(ValueError):
    """A chat dataset is unreadable or a row has no conversation (the message names the row)."""


@dataclass(frozen=True)
class ChatExample:
    """One training row: a conversation (loss on its assistant turns), or a plain-text prompt and
    completion (loss on the completion)."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    completion_text: str | None = None


def is_local_source(source: str) -> bool:
    path = Path(os.path.expanduser(source))
    return path.exists() or source.endswith(FILE_SUFFIXES)


def read_rows(source: str, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of a local file/directory or of a Hub dataset's `split`."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in FILE_SUFFIXES)
        if not files:
            raise ChatDataError(f"{source}: no {'/'.join(FILE_SUFFIXES)} files in this directory")
        return [row for f in files for row in read_rows(str(f))]
    if source.endswith(FILE_SUFFIXES):
        if not path.is_file():
            raise ChatDataError(f"{source}: no such file")
        return _read_file(path)
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets ships with the project
        raise ChatDataError(f"{source}: reading Hub datasets needs the `datasets` package") from exc
    try:
        data = datasets.load_dataset(source, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - the library's errors name no common base
        raise ChatDataError(f"{source} (split {split or 'train'!r}): cannot load it: {exc}") from exc
    return [dict(r) for r in data]


def _read_file(path: Path) -> list[dict[str, Any]]:
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist())
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            data = json.loads(text)
            return list(data if isinstance(data, list) else data.get("data", []))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise ChatDataError(f"{path}: cannot read it: {exc}") from exc


def example_of(
    row: dict[str, Any], messages_key: str = "messages", tools_key: str = "tools", where: str = ""
) -> ChatExample:
    """The conversation of one row: `messages_key`, else conversational prompt/completion lists
    (joined), else plain-text prompt/completion strings, else Alpaca's instruction/input/output."""
    tools = row.get(tools_key)
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    messages = row.get(messages_key)
    if messages is None and "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return ChatExample(prompt_text=prompt, completion_text=completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = [*prompt, *completion]
    if messages is None and "instruction" in row and "output" in row:  # Alpaca's columns
        user = "\n\n".join(t for t in (row["instruction"], row.get("input")) if t).strip()
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(
            f"{where}: no conversation: expected a non-empty {messages_key!r} list of messages, or "
            f"'prompt' and 'completion' columns (found columns {sorted(row)})"
        )
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatDataError(f"{where}: message {i} is not a {{'role': ..., 'content': ...}} mapping")
        clean.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in clean):
        raise ChatDataError(f"{where}: the conversation has no assistant message to train on")
    return ChatExample(messages=clean, tools=tools or None)


def read_examples(
    source: str, split: str | None = None, messages_key: str = "messages", tools_key: str = "tools"
) -> list[ChatExample]:
    """Every row of `source` as a `ChatExample`."""
    rows = read_rows(source, split)
    if not rows:
        raise ChatDataError(f"{source}: no rows")
    return [example_of(r, messages_key, tools_key, f"{source} row {i}") for i, r in enumerate(rows)]


__all__ = ["ChatDataError", "ChatExample", "example_of", "is_local_source", "read_examples", "read_rows"]
