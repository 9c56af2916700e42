"""What one user does cannot hurt another's records or the server's disk (issue 29, finding 6):
crash-safe checkpoint writes, copies and samplers in the right namespace, futures pruned, the
data directory private, the limits from the server's flags.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tinker_app import ALICE, API, BOB, lab, result, session

from skylift.tinker.checkpoints.meta import META_FILE
from skylift.tinker.service import ServerConfig
from skylift.tinker.storage.store import ModelRow, SessionRow
from skylift.tinker.training.trained_model import ModelConfig

__all__ = ["lab"]


def _alice_run(svc: Any, model_path: str, run_id: str) -> None:
    svc.store.add(SessionRow(id=f"s-{run_id}", tags=[], user_metadata={}, owner="alice"))
    config = ModelConfig(base_model=model_path, model_path=model_path, lora_rank=2).to_json()
    svc.store.add(ModelRow(model_id=run_id, session_id=f"s-{run_id}", base_model=model_path, config=config))


def _writer(payload: str, public: bool = False, fail: bool = False) -> Any:
    def write(directory: Path) -> int:
        directory.mkdir(parents=True)
        (directory / "weights.bin").write_text(payload)
        if fail:
            raise RuntimeError("disk full")
        (directory / META_FILE).write_text(json.dumps({"model": {}, "public": public}))
        return len(payload)

    return write


def test_a_failed_overwrite_leaves_the_old_checkpoint_whole_and_recorded(lab: TestClient) -> None:
    from skylift.tinker.checkpoints.operations import write_checkpoint

    svc = lab.app.state.service  # type: ignore[attr-defined]
    _alice_run(svc, str(lab.tiny_model_dir), "run-overwrite")  # type: ignore[attr-defined]

    async def write(payload: str, fail: bool = False) -> tuple[str, int]:
        return await write_checkpoint(
            svc, _writer(payload, fail=fail), "run-overwrite", "training", "c", None
        )

    path, _ = lab.portal.call(write, "old")  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="disk full"):
        lab.portal.call(write, "new", True)  # type: ignore[union-attr]
    row = svc.store.checkpoint(path)
    assert (Path(row.directory) / "weights.bin").read_text() == "old"
    assert (Path(row.directory) / META_FILE).is_file()
    lab.portal.call(write, "newer")  # type: ignore[union-attr]
    row = svc.store.checkpoint(path)
    assert (Path(row.directory) / "weights.bin").read_text() == "newer"
    siblings = sorted(p.name for p in Path(row.directory).parent.iterdir())
    assert len(siblings) == 1, siblings  # the old version and the failed one are gone
    # a version a crash left behind (written, never recorded) is deleted at the next start
    stray = Path(row.directory).parent / "c#0123456789ab"
    stray.mkdir()
    svc._sweep_unrecorded_versions()
    assert not stray.exists() and Path(row.directory).is_dir()


def test_copying_a_published_checkpoint_gives_the_copy_to_the_caller(lab: TestClient) -> None:
    from skylift.tinker.checkpoints.operations import write_checkpoint

    svc = lab.app.state.service  # type: ignore[attr-defined]
    _alice_run(svc, str(lab.tiny_model_dir), "run-published")  # type: ignore[attr-defined]

    async def write() -> tuple[str, int]:
        return await write_checkpoint(svc, _writer("w", public=True), "run-published", "training", "p", None)

    path, _ = lab.portal.call(write)  # type: ignore[union-attr]
    resp = lab.post(f"{API}/copy_weights", json={"source_path": path, "destination_project_id": "mine"},
                    headers=BOB)  # fmt: skip
    assert resp.status_code == 200, resp.text
    copy = resp.json()["tinker_path"]
    run_id = copy.removeprefix("tinker://").split("/")[0]
    assert lab.get(f"{API}/training_runs/{run_id}", headers=BOB).status_code == 200
    assert lab.get(f"{API}/training_runs/{run_id}", headers=ALICE).status_code == 404
    mine = lab.get(f"{API}/training_runs", headers=BOB).json()["training_runs"]
    assert run_id in [r["training_run_id"] for r in mine], mine


def test_a_sampler_loses_access_when_its_checkpoint_is_unpublished(lab: TestClient) -> None:
    from skylift.tinker.checkpoints.operations import write_checkpoint

    svc = lab.app.state.service  # type: ignore[attr-defined]
    _alice_run(svc, str(lab.tiny_model_dir), "run-shared")  # type: ignore[attr-defined]

    async def write() -> tuple[str, int]:
        return await write_checkpoint(svc, _writer("w", public=True), "run-shared", "sampler", "s", None)

    path, _ = lab.portal.call(write)  # type: ignore[union-attr]
    body = {"session_id": session(lab, BOB), "sampling_session_seq_id": 0, "model_path": path}
    sampler = lab.post(f"{API}/create_sampling_session", json=body, headers=BOB).json()["sampling_session_id"]
    empty = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": {"chunks": []}}

    def sample_error() -> str:
        empty["seq_id"] += 1  # type: ignore[operator]
        resp = lab.post(f"{API}/asample", json=empty, headers=BOB)
        assert resp.status_code == 200, resp.text
        return str(result(lab, resp.json()["request_id"], BOB)["error"])

    assert sample_error() == "prompt is empty"  # the sampler works (an empty prompt starts no engine)
    resp = lab.delete(f"{API}/training_runs/run-shared/checkpoints/sampler_weights/s/publish", headers=ALICE)
    assert resp.status_code == 204, resp.text
    assert sample_error() == f"unknown sampling session {sampler!r}"


def test_futures_never_retrieved_are_pruned_after_their_maximum_age(tmp_path: Path) -> None:
    import datetime as dt

    from skylift.tinker.core.futures import FutureHub
    from skylift.tinker.storage.store import FutureRow, Store

    store = Store(f"sqlite:///{tmp_path / 'f.db'}")

    async def go() -> tuple[bool, bool]:
        hub = FutureHub(store, retention_s=3600.0, max_age_s=60.0)
        old, _ = hub.submit("sample", None)
        new, _ = hub.submit("sample", None)

        async def value() -> dict[str, Any]:
            return {"ok": True}

        for request_id in (old, new):
            await hub.persisted(request_id)
            await hub.execute(request_id, value)
        long_ago = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(seconds=120)
        await asyncio.to_thread(store.update, FutureRow, old, finished_at=long_ago)
        assert await hub.prune() == 1
        gone, kept = store.get(FutureRow, old) is None, store.get(FutureRow, new) is not None
        await hub.close()
        return gone, kept

    assert asyncio.run(go()) == (True, True)
    store.close()


def test_the_data_directory_and_what_the_server_writes_are_private(tmp_path: Path) -> None:
    import stat

    from skylift.tinker.commands import private_data_dir

    old = os.umask(0o022)
    try:
        data = private_data_dir(tmp_path / "data")
        (data / "tinker.db").write_text("x")
        for path in (data, data / "tinker.db"):
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, oct(path.stat().st_mode)
    finally:
        os.umask(old)


def test_request_limits_come_from_the_server_flags(tmp_path: Path) -> None:
    import argparse

    from skylift.tinker.commands import add_tinker_command
    from skylift.tinker.core.limits import RequestLimits

    parser = argparse.ArgumentParser()
    add_tinker_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["tinker", "serve", "--base-model", "m", "--allowed-local-media-path", str(tmp_path),
         "--max-request-mb", "8", "--max-request-cells", "1000", "--future-max-age-s", "60"]
    )  # fmt: skip
    assert args.allowed_local_media_paths == [str(tmp_path)]
    assert (args.max_request_mb, args.max_request_cells, args.future_max_age_s) == (8.0, 1000, 60.0)
    config = ServerConfig(base_models=["m"], allowed_local_media_paths=[tmp_path], max_request_mb=8,
                          max_request_cells=1000)  # fmt: skip
    limits = RequestLimits.from_config(config)
    assert limits == RequestLimits(8 * 1024 * 1024, 1000, (tmp_path,))
