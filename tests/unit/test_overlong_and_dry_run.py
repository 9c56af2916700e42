"""DAPO's soft overlong punishment in the experience, and `skylift train --dry-run`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skylift.algorithms.overlong import overlong_rewards


def test_overlong_rewards_follow_dapos_linear_buffer() -> None:
    # budget 100 tokens, buffer 20: lengths up to 80 keep their reward; 90 loses half the factor;
    # 100 loses the whole factor; over the budget (multi-turn) gets 0
    out = overlong_rewards([1.0] * 5, [80, 81, 90, 100, 101], max_len=100, buffer_len=20, factor=0.5)
    assert out == pytest.approx([1.0, 1.0 - 0.025, 0.75, 0.5, 0.0])
    assert overlong_rewards([1.0, 0.0], [100, 100], max_len=100, buffer_len=0, factor=1.0) == [1.0, 0.0]
    with pytest.raises(ValueError, match="longer than the 10-token budget"):
        overlong_rewards([1.0], [5], max_len=10, buffer_len=20, factor=1.0)


def test_experience_applies_the_overlong_penalty_before_advantages() -> None:
    from skylift.config.algorithm import AlgorithmConfig, OverlongBufferConfig
    from skylift.generator import Trajectory
    from skylift.rl.experience import ExperienceStages, make_experience
    from skylift.rl.staleness import StalenessPolicy

    def traj(uid: str, n: int) -> Trajectory:
        return Trajectory(
            uid=uid,
            prompt_ids=[1, 2],
            response_ids=[3] * n,
            loss_mask=[1] * n,
            rollout_logprobs=[0.0] * n,
            reward=1.0,
            stop_reason="stop",
        )

    trajectories = [traj("a", 4), traj("a", 10)]  # same reward; the long one is in the buffer
    rollout = StalenessPolicy(old_logprobs="rollout")
    plain = make_experience(trajectories, ExperienceStages.of(staleness=rollout), 0)
    shaped = make_experience(
        trajectories,
        ExperienceStages.of(
            AlgorithmConfig(overlong_buffer=OverlongBufferConfig(len=4, penalty_factor=1.0)),
            rollout,
            max_response_len=10,
        ),
        0,
    )
    assert plain.batch.extras["advantages"].abs().sum() == 0  # equal rewards: no signal
    adv = shaped.batch.extras["advantages"][:, 0]
    assert adv[0] > 0 > adv[1]  # the overlong response is now the worse one
    assert shaped.metrics["overlong/penalty_mean"] == pytest.approx(0.5)


def test_train_dry_run_validates_prints_and_starts_nothing() -> None:
    code = (
        "import sys; from skylift.cli import main; "
        "rc = main(['train', '--dry-run', 'trainer.strategy=fsdp', 'trainer.algorithm.overlong_buffer_len=32']); "
        "assert 'skylift.rl.loop' not in sys.modules and 'vllm' not in sys.modules, 'dry run imported the trainer'; "
        "sys.exit(rc)"
    )
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "strategy: fsdp2" in ok.stdout and "len: 32" in ok.stdout
    assert "the configuration is valid; nothing was started" in ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "skylift.cli", "train", "--dry-run", "trainer.strategy=megatron"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "skylift has no Megatron backend" in bad.stderr


def test_a_dry_run_notes_a_model_path_that_names_no_directory() -> None:
    """The dry run may run where the model is not (a cluster's nodes hold it): a note, not an error;
    the run itself stops at its start with one line (`skylift.models.ModelPathError`)."""
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "skylift.cli",
            "train",
            "--dry-run",
            "trainer.policy.model.path=/no/such/model",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0, dry.stderr
    assert "note: trainer.policy.model.path=/no/such/model names no directory on this machine" in dry.stderr
