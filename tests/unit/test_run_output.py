"""What a run shows: the plot's series and title, the step lines, the libraries' quiet defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.rl.console import Console, step_summary
from skylift.tracking.plot import accuracy_series, plot_run, run_title
from skylift.utils.quiet import QUIET_ENV, quiet_libraries

STEP = {
    "reward/mean": 0.25,
    "response_length/mean": 12.0,
    "timing/generate_s": 1.0,
    "timing/wait_s": 1.0,
    "timing/train_s": 2.0,
    "timing/weight_sync_s": 0.5,
    "timing/idle_s": 0.1,
}


def test_one_data_source_draws_accuracy_once_several_draw_each() -> None:
    one = [{"step": 0, "eval/accuracy": 0.3, "eval/addition/accuracy": 0.3}]
    assert accuracy_series(one) == ["eval/accuracy"]
    two = [{"step": 0, "eval/accuracy": 0.3, "eval/a/accuracy": 0.2, "eval/b/accuracy": 0.4}]
    assert accuracy_series(two) == ["eval/a/accuracy", "eval/accuracy", "eval/b/accuracy"]


def test_a_data_source_with_a_slash_is_still_one_source() -> None:
    # the demo's data source is "skylift/addition-demo": its per-source key has three slashes
    demo = [{"step": 0, "eval/accuracy": 0.34, "eval/skylift/addition-demo/accuracy": 0.34}]
    assert accuracy_series(demo) == ["eval/accuracy"]
    two = [
        {
            "step": 0,
            "eval/accuracy": 0.5,
            "eval/openai/gsm8k/accuracy": 0.4,
            "eval/skylift/addition-demo/accuracy": 0.6,
        }
    ]
    assert accuracy_series(two) == [
        "eval/accuracy",
        "eval/openai/gsm8k/accuracy",
        "eval/skylift/addition-demo/accuracy",
    ]


def test_plot_is_titled_with_the_run(tmp_path: Path) -> None:
    logs = tmp_path / "my-run" / "logs"
    logs.mkdir(parents=True)
    rows = [
        {"step": 0, "eval/accuracy": 0.3, "eval/addition/accuracy": 0.3},
        {"step": 1, **STEP},
        {"step": 2, **STEP, "eval/accuracy": 0.5, "eval/addition/accuracy": 0.5},
    ]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_title(logs / "metrics.jsonl") == "my-run"  # not "logs"
    out = plot_run(logs)
    assert out == logs / "training_curves.png" and out.stat().st_size > 0
    assert plot_run(logs, tmp_path / "titled.png", title="demo: x").is_file()


def test_step_line_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    console = Console(enabled=True)
    console.start_progress(total=3, done=0)
    console.step_done(1, 3, dict(STEP))
    console.close_progress()
    out = capsys.readouterr()
    assert out.out.strip() == step_summary(1, 3, dict(STEP))
    assert out.out.startswith("step 1/3 | reward 0.250 | resp len 12.0 |")
    assert "training:" not in out.err  # no bar drawn into a log file


def test_quiet_defaults_leave_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    quiet_libraries(verbose=True)
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ  # --verbose: every library as it is
    quiet_libraries()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


C10D = """
import os, tempfile, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "rdzv"),
                        rank=0, world_size=1)
store = dist.TCPStore("127.0.0.1", 0, 1, True)
dist.destroy_process_group()
"""


def test_torch_cpp_warnings_follow_the_quiet_default() -> None:
    """c10d's TCP store warns where the peer's host name does not resolve (loopback namespaces);
    the quiet default silences PyTorch's C++ warnings, verbose shows them."""
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    loud = subprocess.run([sys.executable, "-c", C10D], env=env, capture_output=True, text=True, timeout=120)
    quiet = subprocess.run(
        [sys.executable, "-c", C10D], env={**env, **QUIET_ENV}, capture_output=True, text=True, timeout=120
    )
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "[W" not in quiet.stderr, quiet.stderr
    if "[W" not in loud.stderr:
        pytest.skip("this machine's resolver names the peer: no C++ warning to silence")


DCP_ONE_RANK = """
import tempfile, torch, torch.distributed.checkpoint as dcp
dcp.save({"w": torch.zeros(2)}, checkpoint_id=tempfile.mkdtemp())
"""


def test_a_lone_ranks_checkpoint_note_follows_the_quiet_default() -> None:
    """A one-rank run's worker saves its checkpoint without a process group, as it should;
    torch.distributed.checkpoint says so in a UserWarning that the quiet default silences in the
    processes a run starts (its Ray workers inherit `PYTHONWARNINGS`), and verbose shows."""
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    loud = subprocess.run(
        [sys.executable, "-c", DCP_ONE_RANK], env=env, capture_output=True, text=True, timeout=120
    )
    quiet = subprocess.run(
        [sys.executable, "-c", DCP_ONE_RANK],
        env={**env, **QUIET_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "torch.distributed is disabled" in loud.stderr
    assert "Warning" not in quiet.stderr, quiet.stderr


def test_a_routing_replay_step_says_how_much_routing_it_overrode() -> None:
    line = step_summary(
        2, 3, {**STEP, "policy/logprob_diff_vs_rollout": 1.7e-3, "policy/routing_differs": 0.0026}
    )
    assert "| |lp diff| 1.7e-03 | replayed routing differs 0.26% | gen 1.0s" in line
    assert "routing" not in step_summary(2, 3, dict(STEP))
