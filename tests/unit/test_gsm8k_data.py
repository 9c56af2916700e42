"""GSM8K preparation: schema, values, bad-row reporting, strict mode, sources and the CLI."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.data.commands import add_data_command
from skylift.data.gsm8k import (
    GSM8K_INSTRUCTION,
    BadRowsError,
    GSM8KSourceError,
    parse_gsm8k_answer,
    prepare_gsm8k,
)


def _expected_ground_truth(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skylift")
    add_data_command(parser.add_subparsers(dest="command", required=True))
    return parser


def _write_jsonl(folder: Path, name: str, lines: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(line + "\n" for line in lines))


@pytest.fixture
def bad_gsm8k(tmp_path: Path) -> Path:
    """A GSM8K-shaped folder whose train split has one bad row of each kind."""
    src = tmp_path / "src"
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    _write_jsonl(
        src,
        "train.jsonl",
        [
            json.dumps(good),  # 0 good
            json.dumps({"question": "No answer here?"}),  # 1 missing answer
            json.dumps({"question": "Q?", "answer": "the answer is 7"}),  # 2 no ####
            json.dumps({"question": "Q?", "answer": "so\n#### abc"}),  # 3 unparsable
            "{not json",  # 4 invalid JSON
            json.dumps({"question": "Big?", "answer": "sum\n#### $1,234"}),  # 5 good, with , and $
            json.dumps({"answer": "#### 1"}),  # 6 missing question
        ],
    )
    _write_jsonl(src, "test.jsonl", [json.dumps(good)])
    return src


def test_prepare_small_schema_and_values(gsm8k_dir: Path, tmp_path: Path) -> None:
    result = prepare_gsm8k(tmp_path / "out", gsm8k_dir, max_train=40, max_val=15)

    assert result.num_rows == {"train": 40, "validation": 15}
    assert result.bad_rows == []
    assert result.files["train"] == tmp_path / "out" / "train.parquet"
    table = pq.read_table(result.files["train"])
    assert table.schema.names == ["data_source", "prompt", "env_class", "reward_spec", "extra_info"]
    assert table.schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    assert table.schema.field("reward_spec").type == pa.struct(
        [("method", pa.string()), ("ground_truth", pa.string())]
    )
    extra = table.schema.field("extra_info").type
    assert {extra.field(i).name: extra.field(i).type for i in range(extra.num_fields)} == {
        "split": pa.string(),
        "index": pa.int64(),
        "question": pa.string(),
        "answer": pa.string(),
    }

    source = _read_jsonl(gsm8k_dir / "train.jsonl")[:40]
    for i, (row, raw) in enumerate(zip(table.to_pylist(), source, strict=True)):
        assert row["data_source"] == "openai/gsm8k"
        assert row["env_class"] == "gsm8k"
        assert row["prompt"] == [
            {"role": "user", "content": raw["question"].strip() + " " + GSM8K_INSTRUCTION}
        ]
        assert row["reward_spec"] == {"method": "rule", "ground_truth": _expected_ground_truth(raw["answer"])}
        assert row["extra_info"] == {
            "split": "train",
            "index": i,
            "question": raw["question"],
            "answer": raw["answer"],
        }

    val = pq.read_table(result.files["validation"]).to_pylist()
    test_source = _read_jsonl(gsm8k_dir / "test.jsonl")[:15]
    assert [r["extra_info"]["split"] for r in val] == ["test"] * 15
    assert [r["extra_info"]["question"] for r in val] == [r["question"] for r in test_source]


def test_prepare_full_gsm8k(gsm8k_dir: Path, tmp_path: Path) -> None:
    result = prepare_gsm8k(tmp_path / "full", gsm8k_dir)
    print(f"\nfull GSM8K preparation: {result.num_rows} in {result.seconds:.2f} s")
    assert result.num_rows == {"train": 7473, "validation": 1319}
    assert result.bad_rows == []
    assert pq.read_metadata(result.files["train"]).num_rows == 7473
    assert pq.read_metadata(result.files["validation"]).num_rows == 1319
    ground_truths = (
        pq.read_table(result.files["train"], columns=["reward_spec"]).column("reward_spec").to_pylist()
    )
    assert all("," not in g["ground_truth"] for g in ground_truths)
    assert result.seconds < 60


def test_bad_rows_reported_with_indices(
    bad_gsm8k: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="skylift.data.gsm8k"):
        result = prepare_gsm8k(tmp_path / "out", bad_gsm8k)

    bad = {b.index: b for b in result.bad_rows}
    assert sorted(bad) == [1, 2, 3, 4, 6]
    assert all(b.split == "train" for b in result.bad_rows)
    assert "missing answer" in bad[1].reason
    assert "####" in bad[2].reason
    assert "abc" in bad[3].reason
    assert "JSON" in bad[4].reason
    assert "question" in bad[6].reason
    rows = pq.read_table(result.files["train"]).to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == [0, 5]
    assert rows[1]["reward_spec"]["ground_truth"] == "1234"
    assert "5 bad row(s)" in caplog.text and "train[3]" in caplog.text
    assert "train[1]" in result.summary()


def test_strict_raises_and_writes_nothing(bad_gsm8k: Path, tmp_path: Path) -> None:
    with pytest.raises(BadRowsError, match=r"train\[1\].*train\[2\]") as info:
        prepare_gsm8k(tmp_path / "out", bad_gsm8k, strict=True)
    assert [b.index for b in info.value.bad_rows] == [1, 2, 3, 4, 6]
    assert not (tmp_path / "out").exists()


def test_max_rows_limit_what_is_read(bad_gsm8k: Path, tmp_path: Path) -> None:
    result = prepare_gsm8k(tmp_path / "out", bad_gsm8k, max_train=2, max_val=0, strict=False)
    assert result.num_rows == {"train": 1, "validation": 0}
    assert [b.index for b in result.bad_rows] == [1]
    assert pq.read_metadata(result.files["validation"]).num_rows == 0


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("x\n#### 72", "72"), ("#### 1,080", "1080"), ("#### -3", "-3"), ("#### $5", "5"), ("#### 2.5 ", "2.5")],
)
def test_parse_gsm8k_answer(answer: str, expected: str) -> None:
    assert parse_gsm8k_answer(answer) == expected


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (None, "missing answer"),
        ("", "empty"),
        ("42", "no '####'"),
        ("#### abc", "cannot parse"),
        (3, "not a string"),
    ],
)
def test_parse_gsm8k_answer_errors(answer: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_gsm8k_answer(answer)


def test_missing_local_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(GSM8KSourceError, match="not a folder"):
        prepare_gsm8k(tmp_path / "out", tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.jsonl").write_text("")
    with pytest.raises(GSM8KSourceError, match="test.jsonl"):
        prepare_gsm8k(tmp_path / "out", tmp_path / "half")


def test_hub_source_unavailable_points_to_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `datasets` is not a dependency; when it is missing or offline the error must say what to do.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(GSM8KSourceError, match="--local-path"):
        prepare_gsm8k(tmp_path / "out")


def test_cli_gsm8k(gsm8k_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(
        [
            "data",
            "gsm8k",
            "--out",
            str(tmp_path / "o"),
            "--local-path",
            str(gsm8k_dir),
            "--max-train",
            "8",
            "--max-val",
            "4",
        ]
    )
    assert args.func(args) == 0
    assert pq.read_metadata(tmp_path / "o" / "train.parquet").num_rows == 8
    assert pq.read_metadata(tmp_path / "o" / "validation.parquet").num_rows == 4
    assert "train: 8 rows" in capsys.readouterr().out


def test_cli_gsm8k_strict_fails(bad_gsm8k: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(
        ["data", "gsm8k", "--out", str(tmp_path / "o"), "--local-path", str(bad_gsm8k), "--strict"]
    )
    assert args.func(args) == 1
    assert "train[1]" in capsys.readouterr().err


def test_cli_rejects_negative_max(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["data", "gsm8k", "--out", str(tmp_path), "--max-train", "-1"])
