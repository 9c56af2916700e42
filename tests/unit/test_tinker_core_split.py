"""A Tinker server trains while it samples: on a small CPU machine its first engine's compute
takes half the cores and the server (its training thread among them) the other half (`colocated_cpu_split`), instead of both
fighting over every core (benchmarks/RESULTS.md, tinker_soak.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from skylift.inference import engine_args
from skylift.tinker.service import ServerConfig, TinkerService


def test_the_first_engine_splits_the_cores_with_the_server(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skylift.utils import affinity

    training, engine = [0], [1]
    monkeypatch.setattr(engine_args, "colocated_cpu_split", lambda: (training, engine))
    bound: list[tuple[int, list[int]]] = []  # (thread id, cores): no real binding in a test
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda tid, cpus: bound.append((tid, cpus)))
    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp_path / 't.db'}", data_dir=tmp_path / "d"
    )
    service = TinkerService(config)
    threads = torch.get_num_threads()
    try:
        service.requests._executor.submit(lambda: None).result(timeout=30)  # the training thread exists
        assert bound == []  # pure SFT: training may use every core
        info = next(iter(service.sampling.base_models))
        host = service.sampling.host(info)  # no engine starts here
        assert host.cpus == engine and not host.started
        train_tid = service.requests._executor.submit(threading.get_native_id).result(timeout=30)
        tasks = {int(t) for t in os.listdir("/proc/self/task")}
        process_wide = {tid for tid, cpus in bound if tid != 0 and cpus == training}
        assert {threading.get_native_id(), train_tid} <= process_wide <= tasks
        assert (0, training) in bound  # the training thread itself, then torch's threads
        assert service.requests._executor.submit(torch.get_num_threads).result(timeout=30) == len(training)
        calls = len(bound)
        assert service.sampling.host(info) is host and len(bound) == calls  # one split, on the first engine
    finally:
        torch.set_num_threads(threads)
        service.requests._executor.shutdown(wait=True)


def test_no_split_leaves_engines_every_core(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_args, "colocated_cpu_split", lambda: None)
    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp_path / 't.db'}", data_dir=tmp_path / "d"
    )
    service = TinkerService(config)
    try:
        host = service.sampling.host(next(iter(service.sampling.base_models)))
        assert host.cpus is None
    finally:
        service.requests._executor.shutdown(wait=True)


def test_the_engines_thread_binds_itself_to_the_engines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its scheduler process, started from that thread, inherits them."""
    from skylift.tinker.sampling.engine_host import EngineHost, EngineSettings
    from skylift.utils import affinity

    bound: list[tuple[int, list[int], str]] = []

    def record(tid: int, cpus: list[int]) -> None:
        bound.append((tid, cpus, threading.current_thread().name))

    monkeypatch.setattr(affinity.os, "sched_setaffinity", record)
    for cpus, expected in (([1], [(0, [1], "tinker-engine-tiny")]), (None, [])):
        bound.clear()
        host = EngineHost("tiny", "/nowhere", EngineSettings(), cpus=cpus)
        loop_thread = host._ensure_loop()
        loop_thread.run(asyncio.sleep(0), timeout_s=30)
        host.close()  # no engine started: stops the loop's thread
        assert loop_thread.closed
        assert bound == expected
