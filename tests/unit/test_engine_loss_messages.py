"""What a user reads when engines are lost (issue 42, item 4): the stop message names a resume
path that exists (its case kept), and carries the cause on one line, without terminal colours or
the engine actor's remote traceback (those go to the log). Over the RL loop's fake parts
(`rl_fakes.py`) and Ray's real `RayTaskError`, built here as an actor would raise it."""

from __future__ import annotations

import asyncio
import logging
import re
import traceback
from pathlib import Path

import pytest
from rl_fakes import FakeGenerator, fake_run
from test_ray_engine_proxy import FakeActorHandle

from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.ray_engine import EngineActor, RayEngineClient
from skylift.inference.types import EngineRequestError, EngineUnavailableError, SamplingParams
from skylift.rl.checkpoint import latest_checkpoint
from skylift.rl.loop import TrainingStoppedError
from skylift.utils.messages import one_line, plain

DIED = "LocalVLLMEngine(engine-0): generate failed: the vLLM engine process died (EngineDeadError)"


def remote_error(cause: Exception) -> Exception:
    """`cause` as Ray raises it in the driver when an actor method raised it: a `RayTaskError`
    that is also an instance of the cause's type, its text the coloured remote traceback."""
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except Exception as exc:  # noqa: BLE001 - the traceback of the raise is the point
        frames = traceback.format_exc()
        error = RayTaskError(
            "EngineActor.generate",
            frames,
            exc,
            proctitle="ray::EngineActor.generate",
            pid=4242,
            ip="127.0.0.1",
            actor_repr="<EngineActor>",
            actor_id="a1",
        )
    return error.as_instanceof_cause()


def test_one_line_drops_colours_traceback_frames_and_rays_header() -> None:
    raw = str(remote_error(EngineUnavailableError(DIED)))
    assert "\x1b[" in raw and "File " in raw and "\n" in raw  # what reached the message before
    assert one_line(raw) == f"skylift.utils.engine_errors.EngineUnavailableError: {DIED}"
    assert plain("\x1b[31mred\x1b[0m and \x1b[1;36mbold cyan\x1b[39m") == "red and bold cyan"
    assert one_line("first line\nsecond line") == "first line second line"
    assert one_line("  only indented  ") == "only indented"  # nothing left: the text itself


@pytest.mark.parametrize(
    "cause",
    [EngineUnavailableError(DIED), EngineRequestError("LocalVLLMEngine(engine-0): generate: bad")],
)
def test_an_engine_error_from_the_actor_keeps_its_type_and_loses_the_traceback(
    cause: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    async def raises() -> None:
        raise remote_error(cause)

    actor = EngineActor()
    client = RayEngineClient(FakeActorHandle(actor, instead=raises), name="LocalVLLMEngine(engine-0)")
    with caplog.at_level(logging.INFO, logger="skylift.inference.ray_engine"):
        with pytest.raises(type(cause)) as info:
            asyncio.run(client.generate([[1]], SamplingParams()))
    assert str(info.value) == str(cause)  # one line, no colours, no frames
    assert "File " in caplog.text and "ray::EngineActor.generate()" in caplog.text  # the detail: in the log
    assert "\x1b[" not in caplog.text


def test_a_pool_that_lost_its_actor_engine_names_it_on_one_line() -> None:
    async def raises() -> None:
        raise remote_error(EngineUnavailableError(DIED))

    actor = EngineActor()
    client = RayEngineClient(FakeActorHandle(actor, instead=raises), name="LocalVLLMEngine(engine-0)")
    with pytest.raises(NoHealthyEngineError) as info:
        asyncio.run(EnginePool([client]).generate([[1]], SamplingParams()))
    message = str(info.value)
    assert "\n" not in message and "\x1b[" not in message and "LocalVLLMEngine(engine-0)" in message


def _stop(root: Path, *overrides: str) -> str:
    """The stop message of a run that loses its engines in step 3; the failure text is what a pool
    of one Ray engine raised before: a coloured remote traceback inside."""
    cause = NoHealthyEngineError(
        f"no healthy inference engine left (1 failed): engine 0 (LocalVLLMEngine(engine-0)): "
        f"{remote_error(EngineUnavailableError(DIED))}"
    )
    run = fake_run(root, *overrides, generator=FakeGenerator(fail_after_calls=2, fail_with=lambda: cause))
    with pytest.raises(TrainingStoppedError, match="resume_mode=latest") as stopped:
        run.trainer.fit()
    run.close()
    return str(stopped.value)


def test_the_stop_message_names_the_saved_checkpoint_as_it_is_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "Runs" / "MyRun-A"
    message = _stop(root)
    found = re.search(r"\. Saved step 2 to (.+?)\. Bring the engines back", message)
    assert found, message
    assert Path(found.group(1)) == root / "ckpts" / "global_step_2" == latest_checkpoint(root / "ckpts")
    assert Path(found.group(1)).is_dir()
    assert "\n" not in message and "\x1b[" not in message and "File " not in message, message
    assert "LocalVLLMEngine(engine-0)" in message and "the vLLM engine process died" in message


def test_the_stop_message_names_a_checkpoint_written_before_the_loss(tmp_path: Path) -> None:
    root = tmp_path / "CamelCase Dir" / "Run"
    message = _stop(root, "trainer.ckpt_interval=2")
    found = re.search(r"\. Step 2 was already checkpointed at (.+?)\. Bring", message)
    assert found, message
    assert Path(found.group(1)).is_dir() and Path(found.group(1)) == root / "ckpts" / "global_step_2"
