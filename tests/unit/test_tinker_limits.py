"""Requests that must not hurt a shared Tinker server (issue 29), against the real app in-process
(no engine is ever started: every request here is refused or needs none).

Each test names the finding it covers; each failed on the code before the fix (a 500, a 200 or a
read of any file) and gets a 4xx naming the limit or option now.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.app import create_app
from skylift.tinker.backend import ModelConfig
from skylift.tinker.checkpoint_meta import META_FILE
from skylift.tinker.errors import UserError
from skylift.tinker.service import ServerConfig
from skylift.tinker.store import ModelRow, SessionRow
from skylift.tinker.vision.images import MAX_IMAGE_BYTES, read_pointer

API = "/api/v1"
ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}
MAX_LEN = 64
MAX_MB = 1.0
CELLS = 100_000


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    """One app with two users, a 1 MiB body limit, 100k loss cells and a 64-token context."""
    tmp = tmp_path_factory.mktemp("tinker-limits")
    keys = tmp / "keys"
    keys.write_text("alice tml-alice\nbob tml-bob\n")
    media = tmp / "media"
    media.mkdir()
    config = ServerConfig(
        base_models=[str(tiny_model_dir)],
        db_url=f"sqlite:///{tmp / 'tinker.db'}",
        data_dir=tmp / "data",
        api_keys_file=keys,
        max_model_len=MAX_LEN,
        max_request_mb=MAX_MB,
        max_request_cells=CELLS,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        client.tiny_model_dir = tiny_model_dir  # type: ignore[attr-defined]
        yield client


def _session(client: TestClient, headers: dict[str, str]) -> str:
    resp = client.post(f"{API}/create_session", json={"tags": []}, headers=headers)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["session_id"])


def _result(client: TestClient, request_id: str, headers: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        resp = client.post(f"{API}/retrieve_future", json={"request_id": request_id}, headers=headers)
        if resp.status_code != 408:
            assert resp.status_code == 200, resp.text
            return dict(resp.json())
    raise AssertionError(f"future {request_id} did not finish")


def _healthy(client: TestClient) -> None:
    assert client.get(f"{API}/healthz").json() == {"status": "ok"}
    assert client.get(f"{API}/training_runs", headers=ALICE).status_code == 200


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def _tensor(values: list[int] | None = None, shape: list[int] | None = None, **sparse: bytes) -> pb.Tensor:
    if sparse:
        return pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape or [], sparse_csr=pb.SparseCsr(**sparse))
    data = np.asarray(values or [], dtype="<i8").tobytes()
    return pb.Tensor(dense=data, dtype=pb.DTYPE_INT64, shape=shape or [len(values or [])])


def _fb(model_id: str, tokens: list[int], targets: pb.Tensor | None = None) -> bytes:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(targets if targets is not None else _tensor(tokens))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    msg.data.append(datum)
    return msg.SerializeToString()


# ---------------------------------------------------------------- finding 1: image pointers
def _pointer_sample(client: TestClient, location: str) -> dict[str, Any]:
    chunk = {"type": "image_asset_pointer", "location": location, "format": "png"}
    sample = {
        "sampling_session_id": _sampler(client),
        "seq_id": 1,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, chunk]},
        "sampling_params": {"max_tokens": 1},
    }
    resp = client.post(f"{API}/asample", json=sample, headers=ALICE)
    assert resp.status_code == 200, resp.text
    return _result(client, resp.json()["request_id"], ALICE)


def test_image_pointers_are_refused_unless_the_operator_allows_a_directory(
    lab: TestClient, tmp_path: Path
) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(_png())
    result = _pointer_sample(lab, str(image))
    assert result["category"] == "user", result
    assert "image_asset_pointer chunks are refused" in result["error"], result
    assert "--allowed-local-media-path" in result["error"], result
    _healthy(lab)


def test_image_pointers_read_only_regular_files_under_the_allowed_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "sub").mkdir()
    good = root / "sub" / "cat.png"
    good.write_bytes(_png())
    (outside / "secret.png").write_bytes(_png())
    os.symlink(outside / "secret.png", root / "link.png")
    os.symlink(outside, root / "linkdir")
    os.mkfifo(root / "fifo.png")
    (root / "big.png").write_bytes(b"\0" * (MAX_IMAGE_BYTES + 1))
    roots = [root.resolve()]
    where = "prompt chunk 1"
    assert read_pointer(str(good), where, roots) == good.read_bytes()
    assert read_pointer(good.as_uri(), where, roots) == good.read_bytes()
    refused = [
        str(root / "missing.png"),  # missing and forbidden: the same message
        str(outside / "secret.png"),
        str(root / "sub" / ".." / ".." / "outside" / "secret.png"),
        str(root / "link.png"),
        str(root / "linkdir" / "secret.png"),
        str(root / "sub"),
        str(root),
        "/dev/zero",
        "/etc/passwd",
        "relative/cat.png",
    ]
    messages = set()
    for location in refused:
        with pytest.raises(UserError) as err:
            read_pointer(location, where, roots)
        messages.add(str(err.value).replace(repr(location), "<location>"))
    assert messages == {
        f"{where}: cannot read image <location>: not a readable regular file under the allowed media "
        "directories (--allowed-local-media-path)"
    }
    # a FIFO nobody writes to is refused at once (it would block a reader forever)
    done: list[BaseException] = []

    def read_fifo() -> None:
        try:
            read_pointer(str(root / "fifo.png"), where, roots)
        except UserError as exc:
            done.append(exc)

    reader = threading.Thread(target=read_fifo, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert len(done) == 1 and "not a readable regular file" in str(done[0])
    with pytest.raises(UserError, match=f"larger than {MAX_IMAGE_BYTES} bytes"):
        read_pointer(str(root / "big.png"), where, roots)
    with pytest.raises(UserError, match="refused"):
        read_pointer(str(good), where, [])
    # the operator's root may itself be a link: pointers are matched against it as named
    os.symlink(root, tmp_path / "media-link")
    assert read_pointer(str(tmp_path / "media-link" / "sub" / "cat.png"), where, [tmp_path / "media-link"])


def test_a_decompression_bomb_image_is_refused_from_its_header() -> None:
    from PIL import Image

    from skylift.tinker.vision.images import MAX_IMAGE_PIXELS, check_image

    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, "PNG")  # 25 Mpixels in a few KiB
    assert len(buf.getvalue()) < 64 * 1024
    with pytest.raises(UserError, match=f"5000x5000 pixels; at most {MAX_IMAGE_PIXELS} pixels"):
        check_image(buf.getvalue(), "png", "datum 0 chunk 1")


# ---------------------------------------------------------------- finding 2: zstd bodies
def test_a_zstd_bomb_is_refused_at_the_limit_on_both_routes(lab: TestClient) -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (64 * 1024 * 1024))  # declares its size
    assert len(bomb) < 64 * 1024
    headers = {**ALICE, "Content-Encoding": "zstd", "Content-Type": "application/x-protobuf"}
    for route in ("forward_backward", "forward"):
        resp = lab.post(f"{API}/{route}", content=bomb, headers=headers)
        assert resp.status_code == 413, (route, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert "decompressed body is larger than this server's limit of 1048576 bytes" in error, error
        assert "--max-request-mb" in error, error
    raw = lab.post(f"{API}/forward_backward", content=b"\0" * (2 * 1024 * 1024), headers=ALICE)
    assert raw.status_code == 413 and "--max-request-mb" in raw.json()["error"], raw.text
    # /forward takes zstd like /forward_backward: a small valid body is accepted
    small = zstandard.ZstdCompressor().compress(_fb("s-nobody:train:0", [1, 2, 3]))
    resp = lab.post(f"{API}/forward", content=small, headers=headers)
    assert resp.status_code == 200 and "request_id" in resp.json(), resp.text
    result = _result(lab, resp.json()["request_id"], ALICE)
    assert result["category"] == "user" and "unknown model id" in result["error"], result
    _healthy(lab)


# ---------------------------------------------------------------- finding 3: sparse loss inputs
def test_sparse_loss_inputs_are_checked_before_they_are_made_dense(lab: TestClient) -> None:
    empty = np.zeros(4, dtype="<i8").tobytes()
    huge = _tensor(shape=[3, 2**33], crow_indices=empty, col_indices=b"", values=b"")
    resp = lab.post(f"{API}/forward_backward", content=_fb("s-x:train:0", [1, 2, 3], huge), headers=ALICE)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "25769803776 cells" in error and "--max-request-cells" in error, error
    long_rows = _tensor(shape=[MAX_LEN + 1, 1], crow_indices=np.zeros(MAX_LEN + 2, "<i8").tobytes(),
                        col_indices=b"", values=b"")  # fmt: skip
    resp = lab.post(
        f"{API}/forward_backward", content=_fb("s-x:train:0", [1, 2, 3], long_rows), headers=ALICE
    )
    assert resp.status_code == 400 and f"longest context served here is {MAX_LEN}" in resp.text, resp.text
    # the padded batch is counted too: a long datum beside a wide one
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(_fb("s-x:train:0", list(range(1, MAX_LEN + 1))))
    wide = pb.ForwardBackwardRequest()
    crow = np.asarray([0, 0], dtype="<i8").tobytes()
    wide.ParseFromString(
        _fb("s-x:train:0", [1], _tensor(shape=[1, 1600], crow_indices=crow, col_indices=b"", values=b""))
    )
    msg.data.append(wide.data[0])
    resp = lab.post(f"{API}/forward_backward", content=msg.SerializeToString(), headers=ALICE)
    assert resp.status_code == 400 and "--max-request-cells" in resp.text, resp.text
    _healthy(lab)


def test_a_datum_longer_than_the_context_is_refused_at_once(lab: TestClient) -> None:
    session = _session(lab, ALICE)
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": str(lab.tiny_model_dir),  # type: ignore[attr-defined]
        "lora_config": {"rank": 2},
    }
    created = lab.post(f"{API}/create_model", json=body, headers=ALICE).json()
    model_id = created["model_id"]
    assert "model_id" in _result(lab, created["request_id"], ALICE)
    resp = lab.post(f"{API}/forward_backward", content=_fb(model_id, [1] * (MAX_LEN + 1)), headers=ALICE)
    assert resp.status_code == 400, resp.text
    assert f"{MAX_LEN + 1} tokens" in resp.text and f"{MAX_LEN} tokens" in resp.text, resp.text
    ok = lab.post(f"{API}/forward", content=_fb(model_id, [1, 2, 3]), headers=ALICE)
    assert ok.status_code == 200, ok.text
    lab.post(f"{API}/sessions/{session}/finish", json={}, headers=ALICE)


# ---------------------------------------------------------------- finding 4: target prompt logprobs
def _sampler(client: TestClient) -> str:
    body = {
        "session_id": _session(client, ALICE),
        "sampling_session_seq_id": 0,
        "base_model": str(client.tiny_model_dir),  # type: ignore[attr-defined]
    }
    resp = client.post(f"{API}/create_sampling_session", json=body, headers=ALICE)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["sampling_session_id"])


def test_target_prompt_logprobs_shape_is_checked_before_allocation(lab: TestClient) -> None:
    crow = [0] * 2001
    targets = {"data": [], "dtype": "int64", "shape": [2000, 1000],
               "sparse_crow_indices": crow, "sparse_col_indices": []}  # fmt: skip
    body = {"sampling_session_id": _sampler(lab), "num_samples": 1, "prompt": {"chunks": []},
            "target_prompt_logprobs": targets}  # fmt: skip
    resp = lab.post(f"{API}/asample", json=body, headers=ALICE)
    assert resp.status_code == 400, resp.text
    assert "2000000 cells" in resp.json()["error"], resp.text
    targets["shape"] = [2, "x"]
    resp = lab.post(f"{API}/asample", json=body, headers=ALICE)
    assert resp.status_code == 400 and "shape must be" in resp.text, resp.text


# ---------------------------------------------------------------- finding 0 / 7: bad values
@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "message"),
    [
        ("GET", "training_runs?limit=9223372036854775808", {}, 400, "less than or equal to 1000"),
        ("GET", "checkpoints?offset=99999999999999999999", {}, 400, "offset"),
        ("GET", "sessions?limit=100000000000", {}, 400, "limit"),
        (
            "POST",
            "create_sampling_session",
            {"content": b'{"session_id": "S", "sampling_session_seq_id": Infinity}'},
            400,
            "Infinity is not a JSON number",
        ),
        (
            "POST",
            "optim_step",
            {"content": b'{"model_id": "x", "adam_params": {"learning_rate": NaN}}'},
            400,
            "NaN is not a JSON number",
        ),
        ("POST", "create_model", {"json": {"session_id": "S", "model_seq_id": "abc"}}, 400, "model_seq_id"),
        ("POST", "create_model", {"json": {"session_id": "S", "model_seq_id": 1e300}}, 400, "model_seq_id"),
        (
            "POST",
            "create_sampling_session",
            {"json": {"session_id": "S", "sampling_session_seq_id": 1e300}},
            400,
            "sampling_session_seq_id",
        ),
        ("POST", "save_weights", {"json": {"model_id": "x", "seq_id": "one"}}, 200, ""),
    ],
)
def test_bad_values_are_4xx_not_500(
    lab: TestClient, method: str, path: str, kwargs: dict[str, Any], status: int, message: str
) -> None:
    session = _session(lab, ALICE)
    if "json" in kwargs:
        kwargs = {"json": {k: session if v == "S" else v for k, v in kwargs["json"].items()}}
    else:
        kwargs = {k: v.replace(b'"S"', json.dumps(session).encode()) for k, v in kwargs.items()}
    resp = lab.request(method, f"{API}/{path}", headers=ALICE, **kwargs)
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert message in resp.text, resp.text
    _healthy(lab)


def test_a_non_ascii_download_signature_is_a_403(lab: TestClient) -> None:
    resp = lab.get("/signed/external_weights/r/external_weights/n/f?expires=99999999999&sig=%C3%A9t%C3%A9")
    assert resp.status_code == 403 and "invalid download URL signature" in resp.text, resp.text


def test_checkpoint_names_have_no_trailing_newline_and_a_length_cap() -> None:
    from skylift.tinker.views import MAX_NAME_CHARS, check_name, parse_tinker_path

    assert check_name("step-10", "save_weights") == "step-10"
    assert check_name("a" * MAX_NAME_CHARS, "save_weights")
    for bad in ("step\n", "a" * (MAX_NAME_CHARS + 1), "x\ny", "..", "a/b", ""):
        with pytest.raises(UserError, match="invalid checkpoint name"):
            check_name(bad, "save_weights")
    with pytest.raises(UserError, match="invalid checkpoint path"):
        parse_tinker_path("tinker://run/weights/name\n")


# ---------------------------------------------------------------- finding 6: checkpoints, futures
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
    from skylift.tinker.checkpoints import write_checkpoint

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
    from skylift.tinker.checkpoints import write_checkpoint

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
    from skylift.tinker.checkpoints import write_checkpoint

    svc = lab.app.state.service  # type: ignore[attr-defined]
    _alice_run(svc, str(lab.tiny_model_dir), "run-shared")  # type: ignore[attr-defined]

    async def write() -> tuple[str, int]:
        return await write_checkpoint(svc, _writer("w", public=True), "run-shared", "sampler", "s", None)

    path, _ = lab.portal.call(write)  # type: ignore[union-attr]
    body = {"session_id": _session(lab, BOB), "sampling_session_seq_id": 0, "model_path": path}
    sampler = lab.post(f"{API}/create_sampling_session", json=body, headers=BOB).json()["sampling_session_id"]
    empty = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": {"chunks": []}}

    def sample_error() -> str:
        empty["seq_id"] += 1  # type: ignore[operator]
        resp = lab.post(f"{API}/asample", json=empty, headers=BOB)
        assert resp.status_code == 200, resp.text
        return str(_result(lab, resp.json()["request_id"], BOB)["error"])

    assert sample_error() == "prompt is empty"  # the sampler works (an empty prompt starts no engine)
    resp = lab.delete(f"{API}/training_runs/run-shared/checkpoints/sampler_weights/s/publish", headers=ALICE)
    assert resp.status_code == 204, resp.text
    assert sample_error() == f"unknown sampling session {sampler!r}"


def test_futures_never_retrieved_are_pruned_after_their_maximum_age(tmp_path: Path) -> None:
    import datetime as dt

    from skylift.tinker.futures import FutureHub
    from skylift.tinker.store import FutureRow, Store

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
    from skylift.tinker.limits import RequestLimits

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
