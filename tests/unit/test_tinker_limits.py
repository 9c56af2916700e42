"""Requests that must not hurt a shared Tinker server (issue 29, findings 0-4), against the real
app in-process (`tinker_app.lab`: no engine is ever started; every request here is refused or
needs none). Each test failed on the code before the fix (a 500, a 200 or a read of any file) and
gets a 4xx naming the limit or option now.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb
from tinker_app import (
    ALICE,
    API,
    MAX_LEN,
    fb,
    healthy,
    lab,
    png,
    result,
    sampler,
    session,
    tensor,
)

from skylift.tinker.core.images import MAX_IMAGE_BYTES, read_pointer
from skylift.tinker.errors import UserError

__all__ = ["lab"]


# ---------------------------------------------------------------- finding 1: image pointers
def _pointer_sample(client: TestClient, location: str) -> dict[str, Any]:
    chunk = {"type": "image_asset_pointer", "location": location, "format": "png"}
    sample = {
        "sampling_session_id": sampler(client),
        "seq_id": 1,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, chunk]},
        "sampling_params": {"max_tokens": 1},
    }
    resp = client.post(f"{API}/asample", json=sample, headers=ALICE)
    assert resp.status_code == 200, resp.text
    return result(client, resp.json()["request_id"], ALICE)


def test_image_pointers_are_refused_unless_the_operator_allows_a_directory(
    lab: TestClient, tmp_path: Path
) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(png())
    outcome = _pointer_sample(lab, str(image))
    assert outcome["category"] == "user", outcome
    assert "image_asset_pointer chunks are refused" in outcome["error"], outcome
    assert "--allowed-local-media-path" in outcome["error"], outcome
    healthy(lab)


def test_image_pointers_read_only_regular_files_under_the_allowed_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "sub").mkdir()
    good = root / "sub" / "cat.png"
    good.write_bytes(png())
    (outside / "secret.png").write_bytes(png())
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

    from skylift.tinker.core.images import MAX_IMAGE_PIXELS, check_image

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
    small = zstandard.ZstdCompressor().compress(fb("s-nobody:train:0", [1, 2, 3]))
    resp = lab.post(f"{API}/forward", content=small, headers=headers)
    assert resp.status_code == 200 and "request_id" in resp.json(), resp.text
    outcome = result(lab, resp.json()["request_id"], ALICE)
    assert outcome["category"] == "user" and "unknown model id" in outcome["error"], outcome
    healthy(lab)


# ---------------------------------------------------------------- finding 3: sparse loss inputs
def test_sparse_loss_inputs_are_checked_before_they_are_made_dense(lab: TestClient) -> None:
    empty = np.zeros(4, dtype="<i8").tobytes()
    huge = tensor(shape=[3, 2**33], crow_indices=empty, col_indices=b"", values=b"")
    resp = lab.post(f"{API}/forward_backward", content=fb("s-x:train:0", [1, 2, 3], huge), headers=ALICE)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "25769803776 cells" in error and "--max-request-cells" in error, error
    long_rows = tensor(shape=[MAX_LEN + 1, 1], crow_indices=np.zeros(MAX_LEN + 2, "<i8").tobytes(),
                        col_indices=b"", values=b"")  # fmt: skip
    resp = lab.post(f"{API}/forward_backward", content=fb("s-x:train:0", [1, 2, 3], long_rows), headers=ALICE)
    assert resp.status_code == 400 and f"longest context served here is {MAX_LEN}" in resp.text, resp.text
    # the padded batch is counted too: a long datum beside a wide one
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(fb("s-x:train:0", list(range(1, MAX_LEN + 1))))
    wide = pb.ForwardBackwardRequest()
    crow = np.asarray([0, 0], dtype="<i8").tobytes()
    wide.ParseFromString(
        fb("s-x:train:0", [1], tensor(shape=[1, 1600], crow_indices=crow, col_indices=b"", values=b""))
    )
    msg.data.append(wide.data[0])
    resp = lab.post(f"{API}/forward_backward", content=msg.SerializeToString(), headers=ALICE)
    assert resp.status_code == 400 and "--max-request-cells" in resp.text, resp.text
    healthy(lab)


def test_a_datum_longer_than_the_context_is_refused_at_once(lab: TestClient) -> None:
    sid = session(lab, ALICE)
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": str(lab.tiny_model_dir),  # type: ignore[attr-defined]
        "lora_config": {"rank": 2},
    }
    created = lab.post(f"{API}/create_model", json=body, headers=ALICE).json()
    model_id = created["model_id"]
    assert "model_id" in result(lab, created["request_id"], ALICE)
    resp = lab.post(f"{API}/forward_backward", content=fb(model_id, [1] * (MAX_LEN + 1)), headers=ALICE)
    assert resp.status_code == 400, resp.text
    assert f"{MAX_LEN + 1} tokens" in resp.text and f"{MAX_LEN} tokens" in resp.text, resp.text
    ok = lab.post(f"{API}/forward", content=fb(model_id, [1, 2, 3]), headers=ALICE)
    assert ok.status_code == 200, ok.text
    lab.post(f"{API}/sessions/{sid}/finish", json={}, headers=ALICE)


# ---------------------------------------------------------------- finding 4: target prompt logprobs
def test_target_prompt_logprobs_shape_is_checked_before_allocation(lab: TestClient) -> None:
    crow = [0] * 2001
    targets = {"data": [], "dtype": "int64", "shape": [2000, 1000],
               "sparse_crow_indices": crow, "sparse_col_indices": []}  # fmt: skip
    body = {"sampling_session_id": sampler(lab), "num_samples": 1, "prompt": {"chunks": []},
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
        (
            "POST",
            "create_model",
            {"json": {"session_id": "S", "model_seq_id": "abc"}},
            400,
            "malformed request",
        ),
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
    sid = session(lab, ALICE)
    if "json" in kwargs:
        kwargs = {"json": {k: sid if v == "S" else v for k, v in kwargs["json"].items()}}
    else:
        kwargs = {k: v.replace(b'"S"', json.dumps(sid).encode()) for k, v in kwargs.items()}
    resp = lab.request(method, f"{API}/{path}", headers=ALICE, **kwargs)
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert message in resp.text, resp.text
    healthy(lab)


def test_a_non_ascii_download_signature_is_a_403(lab: TestClient) -> None:
    resp = lab.get("/signed/external_weights/r/external_weights/n/f?expires=99999999999&sig=%C3%A9t%C3%A9")
    assert resp.status_code == 403 and "invalid download URL signature" in resp.text, resp.text


def test_checkpoint_names_have_no_trailing_newline_and_a_length_cap() -> None:
    from skylift.tinker.storage.views import MAX_NAME_CHARS, check_name, parse_tinker_path

    assert check_name("step-10", "save_weights") == "step-10"
    assert check_name("a" * MAX_NAME_CHARS, "save_weights")
    for bad in ("step\n", "a" * (MAX_NAME_CHARS + 1), "x\ny", "..", "a/b", ""):
        with pytest.raises(UserError, match="invalid checkpoint name"):
            check_name(bad, "save_weights")
    with pytest.raises(UserError, match="invalid checkpoint path"):
        parse_tinker_path("tinker://run/weights/name\n")
