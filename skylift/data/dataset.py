"""`PromptDataset`: the prompts of one or more parquet files, batched in a seeded, resumable order.

Rows follow `skylift.data.schema`. Each becomes a `PromptSample`; the order of an
epoch is a permutation drawn from ``(seed, epoch)`` alone, so a run resumed at ``(epoch, step)``
sees exactly the batches the interrupted run would have seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from skylift.data.image_prompts import IMAGES_COLUMN, ImagePromptError, has_image_parts, image_messages
from skylift.data.schema import OPTIONAL_COLUMNS, REQUIRED_COLUMNS


class DataFileError(ValueError):
    """A prompt file is unreadable or does not follow the prompt schema (the message names the file)."""


@dataclass(frozen=True)
class PromptSample:
    """One prompt: its chat messages, the environment that scores it and that environment's extras.

    uid: ``"<file index>:<row index>"``, unique within the dataset (used to group the samples of
    one prompt).
    columns: the row's other columns (e.g. text2sql's ``db_id`` and ``data``), which the generator
    passes to environments among their extras.
    """

    prompt: list[dict[str, Any]]  # content: text, or parts with images (`skylift.data.image_prompts`)
    env_class: str
    reward_spec: dict[str, Any]
    extra_info: dict[str, Any]
    data_source: str
    uid: str
    columns: dict[str, Any] = field(default_factory=dict)

    def env_extras(self) -> dict[str, Any]:
        """The extras an environment's ``init(prompt, extras)`` expects."""
        return {
            **self.columns,
            "reward_spec": dict(self.reward_spec),
            "extra_info": dict(self.extra_info),
            "data_source": self.data_source,
            "uid": self.uid,
        }


def _expand(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(os.fspath(path))))


def _as_file_list(files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(files, str | os.PathLike):
        return [_expand(files)]
    return [_expand(f) for f in files]


def _parse_prompt(value: Any, where: str, column: str = "prompt") -> list[dict[str, Any]]:
    if isinstance(value, str):  # a bare string is one user message
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataFileError(
            f"{where}: column {column!r} must be a non-empty list of chat messages, got {value!r:.80}"
        )
    messages = []
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message.get("content") is None
        ):
            raise DataFileError(
                f"{where}: column {column!r} has a message without role/content: {message!r:.80}"
            )
        content = message["content"]  # chat-content parts (images) stay a list
        messages.append(
            {"role": message["role"], "content": content if isinstance(content, list) else str(content)}
        )
    return messages


def load_prompt_file(
    path: str | os.PathLike[str],
    file_index: int = 0,
    default_env_class: str | None = None,
    *,
    prompt_key: str = "prompt",
    env_class_key: str = "env_class",
) -> list[PromptSample]:
    """The samples of one prompt parquet file (see `PromptDataset` for the arguments)."""
    path = _expand(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(f"{path}: not a readable parquet file ({e})") from e
    column_of = {"prompt": prompt_key, "env_class": env_class_key}  # schema name -> column in the file
    wanted = [column_of.get(c, c) for c in REQUIRED_COLUMNS]
    required = [c for c in wanted if not (c == env_class_key and default_env_class)]
    missing = [c for c in required if c not in names]
    if missing:
        raise DataFileError(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(names)})")
    rows = pq.read_table(path).to_pylist()
    own = {*wanted, *OPTIONAL_COLUMNS, IMAGES_COLUMN}
    samples = []
    for row_index, row in enumerate(rows):
        where = f"{path} row {row_index}"
        env_class = row.get(env_class_key) or default_env_class
        if not env_class:
            raise DataFileError(
                f"{where}: column {env_class_key!r} is empty and no default environment was given"
            )
        data_source = row.get("data_source")
        data_source = "" if data_source is None else data_source  # the column is optional
        if not isinstance(data_source, str):
            raise DataFileError(f"{where}: column 'data_source' must be a string, got {data_source!r}")
        prompt = _parse_prompt(row.get(prompt_key), where, prompt_key)
        images = row.get(IMAGES_COLUMN) or []
        if images or has_image_parts(prompt):
            try:
                prompt = image_messages(prompt, list(images), where)
            except ImagePromptError as e:
                raise DataFileError(str(e)) from e
        samples.append(
            PromptSample(
                prompt=prompt,
                env_class=str(env_class),
                reward_spec=dict(row.get("reward_spec") or {}),
                extra_info=dict(row.get("extra_info") or {}),
                data_source=data_source,
                uid=f"{file_index}:{row_index}",
                columns={k: v for k, v in row.items() if k not in own},
            )
        )
    return samples


class PromptDataset(Sequence[PromptSample]):
    """The prompts of a list of parquet files (e.g. ``data.train_data``), in file then row order.

    files: one path or a list of paths (``~`` and ``$VARS`` are expanded).
    default_env_class: used for rows whose ``env_class`` is empty, and makes that column optional.
    max_rows: keep only the first N rows overall (for small runs).
    prompt_key / env_class_key: the columns holding the chat messages and the environment name
    (``data.prompt_key`` / ``data.env_class_key``); the other columns keep their schema names.
    """

    def __init__(
        self,
        files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        default_env_class: str | None = None,
        max_rows: int | None = None,
        prompt_key: str = "prompt",
        env_class_key: str = "env_class",
    ) -> None:
        self.files = _as_file_list(files)
        if not self.files:
            raise ValueError("PromptDataset needs at least one parquet file")
        samples: list[PromptSample] = []
        for file_index, path in enumerate(self.files):
            samples.extend(
                load_prompt_file(
                    path, file_index, default_env_class, prompt_key=prompt_key, env_class_key=env_class_key
                )
            )
        if max_rows is not None:
            samples = samples[:max_rows]
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    @overload
    def __getitem__(self, index: int) -> PromptSample: ...
    @overload
    def __getitem__(self, index: slice) -> list[PromptSample]: ...
    def __getitem__(self, index: int | slice) -> PromptSample | list[PromptSample]:
        return self.samples[index]

    def num_batches(self, batch_size: int, drop_last: bool = True) -> int:
        """Batches per epoch."""
        _check_batch_size(batch_size)
        full, rest = divmod(len(self), batch_size)
        return full if drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
        """The row order of `epoch`: a permutation drawn from (seed, epoch) alone, or 0..n-1."""
        if not shuffle:
            return np.arange(len(self))
        if epoch < 0 or seed < 0:
            raise ValueError(f"epoch and seed must be >= 0, got epoch={epoch}, seed={seed}")
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def iter_batches(
        self,
        batch_size: int,
        epoch: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        *,
        start_step: int = 0,
        shuffle: bool = True,
    ) -> Iterator[list[PromptSample]]:
        """The batches of one epoch, starting at batch `start_step` (to resume an interrupted epoch)."""
        total = self.num_batches(batch_size, drop_last)
        if not 0 <= start_step <= total:
            raise ValueError(f"start_step {start_step} is outside this epoch's 0..{total} batches")
        order = self.epoch_order(epoch, seed, shuffle)
        for step in range(start_step, total):
            yield [self.samples[i] for i in order[step * batch_size : (step + 1) * batch_size]]

    def iter_training(
        self,
        batch_size: int,
        seed: int,
        num_epochs: int,
        *,
        start_epoch: int = 0,
        start_step: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
    ) -> Iterator[tuple[int, int, list[PromptSample]]]:
        """``(epoch, step, batch)`` for every batch of epochs start_epoch..num_epochs-1, resuming at
        (start_epoch, start_step); `shuffle=False` keeps the file order in every epoch."""
        if self.num_batches(batch_size, drop_last) == 0:
            raise ValueError(f"a dataset of {len(self)} prompts gives no full batch of {batch_size}")
        for epoch in range(start_epoch, num_epochs):
            first = start_step if epoch == start_epoch else 0
            for step, batch in enumerate(
                self.iter_batches(batch_size, epoch, seed, drop_last, start_step=first, shuffle=shuffle),
                start=first,
            ):
                yield epoch, step, batch

    def locate(self, global_step: int, batch_size: int, drop_last: bool = True) -> tuple[int, int]:
        """The (epoch, step within the epoch) of the `global_step`-th batch (0-based) of a run."""
        per_epoch = self.num_batches(batch_size, drop_last)
        if per_epoch == 0:
            raise ValueError(f"a dataset of {len(self)} prompts gives no full batch of {batch_size}")
        return divmod(global_step, per_epoch)


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
