"""What a run does when a rollout fails on the user's input: training saves its last completed step
and stops with one line naming the prompt, the cause and how to resume, exit code 4
(`run_trainer`); `skylift eval` says the line with the same code; `--verbose` prints the traceback
before it; anything not marked as the user's input keeps its traceback. Over the RL loop's fake
parts (`rl_fakes.py`), the failure marked as the real generator marks it (`rollout_of`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rl_fakes import FakeGenerator, fake_run

from skylift.generator.rollout_errors import rollout_of
from skylift.rl.checkpoint import latest_checkpoint
from skylift.rl.loop import RolloutInputStoppedError
from skylift.rl.run import run_trainer

CAUSE = "prompt train.parquet:9: MathEnv.step raised ZeroDivisionError: division by zero"


def env_bug(uid: str = "train.parquet:9") -> Exception:
    """A user's environment's exception as `Generator` raises it: marked with its method and prompt."""
    from skylift.generator.rollout_errors import env_raised

    try:
        with rollout_of(uid):
            try:
                _ = 1 / 0
            except ZeroDivisionError as exc:
                env_raised(exc, "MathEnv.step")
                raise
    except ZeroDivisionError as exc:
        return exc
    raise AssertionError("unreachable")


def test_training_saves_the_last_step_and_names_the_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = fake_run(tmp_path, generator=FakeGenerator(fail_after_calls=2, fail_with=env_bug))
    try:
        assert run_trainer(lambda: run.trainer, lambda t: t.fit(), "skylift") == 4
    finally:
        run.loop.stop()
    err = capsys.readouterr().err
    saved = latest_checkpoint(tmp_path / "ckpts")
    assert saved is not None and saved.name == "global_step_2"
    assert err == (
        f"skylift: rollout failed during step 3: {CAUSE}. Saved step 2 to {saved}. Fix the data, the "
        "environment or the limit and rerun the same command with trainer.resume_mode=latest to continue "
        "(--verbose shows the traceback)\n"
    )


def test_a_failure_in_the_first_evaluation_has_nothing_to_save(tmp_path: Path) -> None:
    run = fake_run(
        tmp_path,
        "trainer.eval_before_train=true",
        generator=FakeGenerator(fail_after_calls=0, fail_with=env_bug),
    )
    with pytest.raises(RolloutInputStoppedError) as info:
        run.trainer.fit()
    run.close()
    assert str(info.value).startswith(f"rollout failed during step 1: {CAUSE}. Nothing to save: no step had")
    assert latest_checkpoint(tmp_path / "ckpts") is None


def test_a_checkpointed_step_is_not_saved_again(tmp_path: Path) -> None:
    gen = FakeGenerator(fail_after_calls=2, fail_with=env_bug)
    run = fake_run(tmp_path, "trainer.ckpt_interval=2", generator=gen)
    with pytest.raises(RolloutInputStoppedError, match=r"\. Step 2 was already checkpointed at "):
        run.trainer.fit()
    run.close()


class Trainer:
    def setup(self) -> None: ...

    def shutdown(self) -> None: ...


def _raise(exc: Exception) -> None:
    raise exc


def test_eval_says_the_line_with_code_4(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_trainer(Trainer, lambda t: _raise(env_bug()), "skylift eval") == 4
    assert (
        capsys.readouterr().err == f"skylift eval: rollout failed: {CAUSE} (--verbose shows the traceback)\n"
    )


def test_verbose_prints_the_traceback_before_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_trainer(Trainer, lambda t: _raise(env_bug()), "skylift eval", verbose=True) == 4
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert re.search(r"_ = 1 / 0\n.*ZeroDivisionError: division by zero\n", err, re.S)  # the user's frame
    assert err.endswith(f"skylift eval: rollout failed: {CAUSE} (--verbose shows the traceback)\n")


def test_an_unmarked_error_keeps_its_traceback() -> None:
    """The same exception type, not marked by a rollout (e.g. a bug of ours in the trainer)."""
    with pytest.raises(ZeroDivisionError):
        run_trainer(Trainer, lambda t: _raise(ZeroDivisionError("division by zero")), "skylift")
