"""PromptDataset: loading, typed samples, seeded epoch order, resume, and clear file errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.data.dataset import DataFileError, PromptDataset, PromptSample
from skylift.data.schema import make_row, write_prompt_parquet
from skylift.data.synthetic import write_addition_demo
from skylift.envs import make_env


def _rows(n: int, tag: str) -> list[dict]:
    return [
        make_row(
            data_source=f"test/{tag}",
            prompt=[{"role": "user", "content": f"{tag} question {i}"}],
            env_class="gsm8k",
            ground_truth=str(i),
            extra_info={"split": "train", "index": i, "question": f"q{i}", "answer": f"#### {i}"},
        )
        for i in range(n)
    ]


@pytest.fixture
def two_files(tmp_path: Path) -> list[Path]:
    return [
        write_prompt_parquet(_rows(13, "a"), tmp_path / "a.parquet"),
        write_prompt_parquet(_rows(7, "b"), tmp_path / "b.parquet"),
    ]


def _uids(batches) -> list[list[str]]:
    return [[s.uid for s in batch] for batch in batches]


def test_loads_typed_samples_in_file_order(two_files: list[Path]) -> None:
    ds = PromptDataset([str(p) for p in two_files])
    assert len(ds) == 20
    first, last = ds[0], ds[19]
    assert isinstance(first, PromptSample)
    assert first.prompt == [{"role": "user", "content": "a question 0"}]
    assert first.env_class == "gsm8k" and first.data_source == "test/a"
    assert first.reward_spec == {"method": "rule", "ground_truth": "0"}
    assert first.extra_info == {"split": "train", "index": 0, "question": "q0", "answer": "#### 0"}
    assert (first.uid, last.uid) == ("0:0", "1:6")
    assert len({s.uid for s in ds}) == 20
    assert last.env_extras()["reward_spec"]["ground_truth"] == "6"
    assert len(PromptDataset(two_files, max_rows=5)) == 5


def test_epoch_order_is_deterministic_and_a_permutation(two_files: list[Path]) -> None:
    ds, again = PromptDataset(two_files), PromptDataset(two_files)
    e0 = _uids(ds.iter_batches(4, epoch=0, seed=11))
    assert e0 == _uids(again.iter_batches(4, epoch=0, seed=11))
    assert len(e0) == ds.num_batches(4) == 5
    assert sorted(u for b in e0 for u in b) == sorted(s.uid for s in ds)
    assert e0 != _uids(ds.iter_batches(4, epoch=1, seed=11))
    assert e0 != _uids(ds.iter_batches(4, epoch=0, seed=12))
    assert e0 != [[s.uid for s in ds[i : i + 4]] for i in range(0, 20, 4)]  # shuffled, not file order


def test_drop_last_and_unshuffled_eval(two_files: list[Path]) -> None:
    ds = PromptDataset(two_files)
    assert ds.num_batches(6) == 3 and ds.num_batches(6, drop_last=False) == 4
    dropped = _uids(ds.iter_batches(6, seed=0))
    assert [len(b) for b in dropped] == [6, 6, 6]
    evaluation = _uids(ds.iter_batches(6, drop_last=False, shuffle=False))
    assert [len(b) for b in evaluation] == [6, 6, 6, 2]
    assert [u for b in evaluation for u in b] == [s.uid for s in ds]
    with pytest.raises(ValueError, match="batch_size"):
        ds.num_batches(0)


def test_resume_sees_the_same_order(two_files: list[Path]) -> None:
    ds = PromptDataset(two_files)
    full = [(e, s, [x.uid for x in b]) for e, s, b in ds.iter_training(4, seed=3, num_epochs=3)]
    assert [(e, s) for e, s, _ in full] == [(e, s) for e in range(3) for s in range(5)]

    resumed_ds = PromptDataset(two_files)  # a fresh process after a restart
    epoch, step = resumed_ds.locate(7, batch_size=4)
    assert (epoch, step) == (1, 2)
    resumed = [
        (e, s, [x.uid for x in b])
        for e, s, b in resumed_ds.iter_training(4, 3, 3, start_epoch=epoch, start_step=step)
    ]
    assert resumed == full[7:]
    assert _uids(resumed_ds.iter_batches(4, epoch=1, seed=3, start_step=2)) == [u for _, _, u in full[7:10]]
    assert list(resumed_ds.iter_batches(4, epoch=1, seed=3, start_step=5)) == []
    with pytest.raises(ValueError, match="start_step 6"):
        list(resumed_ds.iter_batches(4, epoch=1, seed=3, start_step=6))
    with pytest.raises(ValueError, match="no full batch"):
        list(resumed_ds.iter_training(64, seed=0, num_epochs=1))


def test_missing_file_is_named(tmp_path: Path, two_files: list[Path]) -> None:
    missing = tmp_path / "nope" / "train.parquet"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        PromptDataset([two_files[0], missing])
    with pytest.raises(ValueError, match="at least one"):
        PromptDataset([])


def test_missing_column_names_file_and_column(tmp_path: Path) -> None:
    path = tmp_path / "no_prompt.parquet"  # data_source, reward_spec and extra_info may be left out
    table = pa.Table.from_pylist(_rows(3, "x")).drop_columns(["prompt"])
    pq.write_table(table, path)
    with pytest.raises(DataFileError, match=rf"{path}.*missing column\(s\) prompt"):
        PromptDataset(path)
    no_source = tmp_path / "no_source.parquet"  # SkyRL's geometry3k and visgym rows have none
    pq.write_table(pa.Table.from_pylist(_rows(3, "x")).drop_columns(["data_source"]), no_source)
    assert [s.data_source for s in PromptDataset(no_source)] == ["", "", ""]


def test_default_env_class_and_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "no_env.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(2, "x")).drop_columns(["env_class"]), path)
    with pytest.raises(DataFileError, match="env_class"):
        PromptDataset(path)
    assert {s.env_class for s in PromptDataset(path, default_env_class="arithmetic")} == {"arithmetic"}

    bad = _rows(3, "y")
    bad[2]["prompt"] = []
    path = tmp_path / "empty_prompt.parquet"
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(DataFileError, match=rf"{path} row 2: column 'prompt'"):
        PromptDataset(path)

    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataFileError, match="not a readable parquet"):
        PromptDataset(junk)


def test_paths_expand_home_and_vars(two_files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYLIFT_TEST_DATA", str(two_files[0].parent))
    assert len(PromptDataset("$SKYLIFT_TEST_DATA/a.parquet")) == 13


def test_demo_dataset_feeds_environments(tmp_path: Path) -> None:
    prepared = write_addition_demo(tmp_path, num_train=16, num_val=8, seed=0)
    ds = PromptDataset([prepared.files["train"]])
    for batch in ds.iter_batches(8, epoch=0, seed=0):
        for sample in batch:
            env = make_env(sample.env_class)
            assert env.init(sample.prompt, sample.env_extras()) == sample.prompt
            assert env.step(sample.extra_info["answer"]).reward == 1.0


def test_training_order_unshuffled_keeps_file_order(two_files: list[Path]) -> None:
    ds = PromptDataset(two_files)
    plain = [
        [s.uid for s in batch] for _, _, batch in ds.iter_training(5, seed=3, num_epochs=2, shuffle=False)
    ]
    in_order = [s.uid for s in ds]
    assert plain == [in_order[0:5], in_order[5:10], in_order[10:15], in_order[15:20]] * 2
    shuffled = [[s.uid for s in batch] for _, _, batch in ds.iter_training(5, seed=3, num_epochs=2)]
    assert shuffled != plain and sorted(sum(shuffled[:4], [])) == sorted(in_order)


def test_prompt_and_env_class_columns_can_be_renamed(tmp_path: Path) -> None:
    """data.prompt_key / data.env_class_key: the columns are read under the configured names."""
    path = write_prompt_parquet(_rows(3, "r"), tmp_path / "r.parquet")
    table = pq.read_table(path)
    names = [
        "question_messages" if n == "prompt" else "environment" if n == "env_class" else n
        for n in table.column_names
    ]
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(table.rename_columns(names), renamed)
    ds = PromptDataset(renamed, prompt_key="question_messages", env_class_key="environment")
    assert [s.prompt for s in ds] == [[{"role": "user", "content": f"r question {i}"}] for i in range(3)]
    assert {s.env_class for s in ds} == {"gsm8k"}
    with pytest.raises(DataFileError, match=r"missing column\(s\) prompt, env_class"):
        PromptDataset(renamed)  # the schema's names are not there
    fallback = PromptDataset(
        renamed, prompt_key="question_messages", env_class_key="nope", default_env_class="x"
    )
    assert {s.env_class for s in fallback} == {"x"}  # a missing env_class column falls back


def test_rows_without_reward_spec_or_extra_info_load_as_the_seeds_mini_swe_rows(tmp_path: Path) -> None:
    """SkyRL's mini-SWE-agent preprocessing writes data_source, prompt, env_class="null" and an
    ``instance`` struct: the task reaches the environment among the row's other columns."""
    instance = {"instance_id": "repo__bug-1", "problem_statement": "fix it", "base_commit": "abc"}
    rows = [
        {
            "data_source": "SWE-Gym",
            "prompt": [{"role": "user", "content": "fix it"}],
            "env_class": "null",
            "instance": instance,
        }
    ]
    path = tmp_path / "swe.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (sample,) = PromptDataset(path)
    assert sample.reward_spec == {} and sample.extra_info == {}
    assert sample.columns == {"instance": instance} and sample.env_class == "null"
