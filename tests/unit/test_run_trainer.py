"""`run_trainer`: the exit code of a command that trains, and the trainer shut down on every path."""

from __future__ import annotations

import pytest

from skylift.cluster.colocation import ColocationError
from skylift.cluster.placement import PlacementError
from skylift.config import ConfigError
from skylift.rl.loop import TrainingStoppedError
from skylift.rl.run import run_trainer
from skylift.utils.engine_errors import EngineStartError, EngineUnavailableError
from skylift.weight_sync.process_group import WeightSyncError


class FakeTrainer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self) -> None:
        self.calls.append("setup")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_the_work_runs_between_setup_and_shutdown() -> None:
    trainer = FakeTrainer()
    assert run_trainer(lambda: trainer, lambda t: t.calls.append("work"), "prog") == 0
    assert trainer.calls == ["setup", "work", "shutdown"]


@pytest.mark.parametrize(
    ("error", "code", "said"),
    [
        (ConfigError("no GPU for the engine"), 2, "prog: configuration error: no GPU for the engine"),
        (TrainingStoppedError("every engine is gone"), 3, "prog: every engine is gone"),
        (
            PlacementError("the cluster cannot hold the requested placement (policy: 2 x {GPU: 1} ...)"),
            2,
            "prog: placement: the cluster cannot hold the requested placement (policy: 2 x {GPU: 1} ...)",
        ),
        (
            ColocationError("the trainer keeps about 70.0 GiB of each 80.0 GiB GPU ..."),
            2,
            "prog: the engines and the trainer do not fit on one GPU: the trainer keeps about 70.0 GiB",
        ),
        (
            EngineStartError("engine-0 did not start: ValueError: No available memory for the cache blocks."),
            2,
            "prog: engine-0 did not start: ValueError: No available memory for the cache blocks.",
        ),
    ],
)
def test_an_error_in_the_work_is_an_exit_code_and_the_trainer_is_shut_down(
    error: Exception, code: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = FakeTrainer()

    def work(t: FakeTrainer) -> None:
        raise error

    assert run_trainer(lambda: trainer, work, "prog") == code
    assert trainer.calls == ["setup", "shutdown"]
    assert said in capsys.readouterr().err


def test_an_engine_lost_outside_trainings_loop_is_one_line_and_code_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An engine (or the weight-update group with it) failing while the run sets up its weight sync
    (the runtime's build) or in work that is not training's loop (`skylift eval`): one line, no
    traceback; training's own loop stops with `TrainingStoppedError` instead."""

    def build() -> FakeTrainer:
        raise WeightSyncError("weight-update group 'g' did not form between rank 0 (hosting it at a:1) and e")

    assert run_trainer(build, lambda t: None, "prog") == 3
    err = capsys.readouterr().err
    assert err.startswith(
        "prog: stopped while setting up: weight-update group 'g' did not form between rank 0 "
    )
    assert "Nothing was saved" in err and "Traceback" not in err and len(err.splitlines()) == 1

    trainer = FakeTrainer()

    def work(t: FakeTrainer) -> None:
        raise EngineUnavailableError("engine-0: generate failed:\nthe vLLM engine process died")

    assert run_trainer(lambda: trainer, work, "prog") == 3
    assert trainer.calls == ["setup", "shutdown"]
    err = capsys.readouterr().err
    assert err.startswith(
        "prog: stopped while running: engine-0: generate failed: the vLLM engine process died."
    )
    assert len(err.splitlines()) == 1


def test_a_failed_build_has_nothing_to_shut_down(capsys: pytest.CaptureFixture[str]) -> None:
    def build() -> FakeTrainer:
        raise ConfigError("bad device")

    assert run_trainer(build, lambda t: None, "prog") == 2
    assert "prog: configuration error: bad device" in capsys.readouterr().err


def test_another_error_propagates_after_shutdown() -> None:
    trainer = FakeTrainer()

    def work(t: FakeTrainer) -> None:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        run_trainer(lambda: trainer, work, "prog")
    assert trainer.calls == ["setup", "shutdown"]


def test_an_unmapped_weight_from_a_ray_worker_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A policy rank (a Ray actor) that cannot map a weight to its checkpoint's names: Ray raises
    the error with the remote traceback in its text; the command says the cause on one line."""
    from ray.exceptions import RayTaskError

    from skylift.models.checkpoint_names import UnmappedWeightError

    cause = UnmappedWeightError(
        "weight sync: the parameter model.layers.0.mlp.experts.gate_up_proj of M has none"
    )
    remote = RayTaskError(
        "RLWorker.broadcast_weights", "Traceback (most recent call last):\n  File 'x.py', line 1\n", cause
    ).as_instanceof_cause()
    trainer = FakeTrainer()

    def work(t: FakeTrainer) -> None:
        raise remote

    assert run_trainer(lambda: trainer, work, "prog") == 2
    err = capsys.readouterr().err
    assert err == f"prog: {cause}\n"
    assert trainer.calls == ["setup", "shutdown"]


#: torch's message for a CUDA allocation that does not fit (torch 2.13's format)
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
    "1.06 GiB is free. Including non-PyTorch memory, this process has 78.04 GiB memory in use. Of the "
    "allocated memory 75.10 GiB is allocated by PyTorch, and 2.30 GiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_a_host_allocation_that_fails_is_exit_code_5_with_what_to_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real allocation failure on this machine (a petabyte: the allocator refuses at once)."""
    import torch

    trainer = FakeTrainer()
    assert run_trainer(lambda: trainer, lambda t: torch.empty(2**50, dtype=torch.uint8), "prog") == 5
    err = capsys.readouterr().err
    assert err.startswith("prog: out of memory: [enforce fail at alloc_cpu.cpp") and err.count("\n") == 1, err
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes" in err
    assert "trainer.micro_train_batch_size_per_gpu" in err and "trainer.resume_mode=latest" in err
    assert trainer.calls == ["setup", "shutdown"]


def test_a_cuda_out_of_memory_in_a_ray_worker_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """torch's CUDA error, raised in a policy rank (a Ray actor): its figures, not the allocator's
    advice or Ray's remote traceback (no GPU here: the error is made with torch's own text)."""
    import torch
    from ray.exceptions import RayTaskError

    remote = RayTaskError(
        "RLWorker.train_step",
        "Traceback (most recent call last):\n  File 'x.py', line 1\n",
        torch.OutOfMemoryError(CUDA_OOM),
    ).as_instanceof_cause()

    def work(t: FakeTrainer) -> None:
        try:
            raise remote
        except RayTaskError as exc:
            raise RuntimeError("policy update failed") from exc  # a wrapper on the way up

    assert run_trainer(FakeTrainer, work, "prog") == 5
    err = capsys.readouterr().err
    assert err.startswith(
        "prog: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.11 GiB of which 1.06 GiB is free."
    )
    assert "2.30 GiB is reserved by PyTorch but unallocated. To fit, lower" in err
    assert "PYTORCH_CUDA_ALLOC_CONF" not in err and "Traceback" not in err and err.count("\n") == 1
