"""A Tinker server trains while it samples: on a small CPU machine its first engine takes half
the cores and the training thread the other half (`colocated_cpu_split`), instead of both
fighting over every core (benchmarks/RESULTS.md, tinker_soak.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from skylift.inference import engine_args
from skylift.tinker.service import ServerConfig, TinkerService

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores"
)


@needs_affinity
def test_the_first_engine_splits_the_cores_with_the_training_thread(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    training, engine = cores[:1], cores[1:]
    monkeypatch.setattr(engine_args, "colocated_cpu_split", lambda: (training, engine))
    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp_path / 't.db'}", data_dir=tmp_path / "d"
    )
    service = TinkerService(config)
    threads = torch.get_num_threads()
    try:
        before = service._executor.submit(os.sched_getaffinity, 0).result(timeout=30)
        assert sorted(before) == cores  # pure SFT: training may use every core
        info = next(iter(service.sampling.base_models))
        host = service.sampling.host(info)  # no engine starts here
        assert host.cpus == engine and not host.started
        after = service._executor.submit(lambda: (os.sched_getaffinity(0), torch.get_num_threads()))
        assert after.result(timeout=30) == (set(training), len(training))
        assert service.sampling.host(info) is host  # one split, on the first engine
        assert sorted(os.sched_getaffinity(0)) == cores  # this thread is left alone
    finally:
        torch.set_num_threads(threads)
        service._executor.shutdown(wait=True)


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
        service._executor.shutdown(wait=True)
