"""`skylift sft` with more GPU ranks than the Ray cluster has GPUs: one line, exit code 2, at start
(each rank's actor takes a GPU, and Ray kept the others waiting until `worker_timeout_s`, an hour
by default, ran out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skylift.cli import main
from skylift.cluster.placement import PlacementError
from skylift.supervised import trainer as sft_trainer
from skylift.supervised.trainer import check_enough_gpus


def test_more_ranks_than_gpus_are_refused_naming_both() -> None:
    check_enough_gpus(4, 4.0)
    with pytest.raises(
        PlacementError, match=r"^8 training rank\(s\) .* need a GPU each, and the Ray cluster has 4: "
    ):
        check_enough_gpus(8, 4.0)


def test_the_command_says_it_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's handling, with the start a 4-GPU machine would make for 8 ranks (this machine
    has no GPU, so the check is driven with that machine's count)."""
    data = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text((json.dumps(row) + "\n") * 8)

    def start(self: sft_trainer.SupervisedTrainer) -> None:
        check_enough_gpus(self.cfg.world_size(), 4.0)

    monkeypatch.setattr(sft_trainer.SupervisedTrainer, "start", start)
    code = main(
        [
            "sft",
            f"model.path={tiny_model_dir}",
            f"train_datasets=[{data}]",
            "batch_size=8",
            "num_steps=1",
            "placement.num_gpus_per_node=8",
            f"runs_dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        "skylift sft: placement: 8 training rank(s) (placement.num_nodes x placement.num_gpus_per_node) need a GPU"
    )
