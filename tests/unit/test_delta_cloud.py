"""Checkpoint-delta weight sync through object storage (``s3://``): the publisher uploads each
version (payloads first, the manifest last) and an engine host mirrors what its store needs, against
a real S3 API (moto's server on 127.0.0.1) with s3fs, the library a user's run uses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from delta_fakes import sent, step, tiny_model

pytest.importorskip("s3fs", reason="s3fs is in skylift's dev extra (pyproject)")
pytest.importorskip("moto", reason="moto[server] is in skylift's dev extra (pyproject)")

from skylift.weight_sync.delta.apply import DeltaStore  # noqa: E402
from skylift.weight_sync.delta.cloud import drop_payloads, mirror_chain  # noqa: E402
from skylift.weight_sync.delta.engine import MIRROR  # noqa: E402
from skylift.weight_sync.delta.format import (  # noqa: E402
    MANIFEST,
    DeltaError,
    DeltaVersionNotFound,
    as_bytes,
    version_dir,
)
from skylift.weight_sync.delta.publish import DeltaPublisher  # noqa: E402
from skylift.weight_sync.protocol import DeltaSyncRequest  # noqa: E402

BUCKET = "skylift-deltas"


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    """An S3 server on loopback, the AWS settings that point s3fs at it, and an empty bucket."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield fs
    server.stop()


def _holds(store: DeltaStore, model: torch.nn.Module) -> bool:
    state = store.state()
    got = dict(store.tensors(store.all_names(), state.run_id, state.version))
    return all(torch.equal(as_bytes(got[n].to(t.dtype)), as_bytes(t)) for n, t in sent(model))


def test_versions_go_through_the_bucket_and_a_late_store_replays_them(s3, tmp_path: Path) -> None:  # noqa: ANN001
    base, staging = tmp_path / "base", tmp_path / "staging"
    model = tiny_model(base)
    uri = f"s3://{BUCKET}/run-a"
    publisher = DeltaPublisher(uri, base, max_file_bytes=64, staging_dir=staging)
    q = "model.layers.0.self_attn.q_proj.weight"
    changes = [[q], ["lm_head.weight", "model.norm.weight"], ["model.layers.1.mlp.up_proj.weight"]]
    for v, names in enumerate(changes, start=1):
        step(model, names, seed=v)
        stats = publisher.publish(sent(model))
        assert stats.version == v and stats.files == len(names)  # a file per frame over 64 bytes
        remote = f"{BUCKET}/run-a/deltas/delta-{v:08d}"
        assert s3.exists(f"{remote}/{MANIFEST}") and len(s3.ls(remote)) == stats.files + 1
    assert not any(p.is_file() for p in staging.rglob("*"))  # uploaded, then removed locally
    store, mirror = DeltaStore(tmp_path / "store", base), tmp_path / "store" / MIRROR
    copied = mirror_chain(uri, 3, mirror, (store.state().run_id, store.state().version))
    assert copied == [3, 2, 1]  # the store held nothing: every version, newest first
    assert store.apply(mirror, 3) == [1, 2, 3] and _holds(store, model)
    drop_payloads(mirror, [1, 2, 3])
    assert sorted(p.name for p in version_dir(mirror, 3).iterdir()) == [MANIFEST]
    assert store.changed_since(mirror, publisher.run_id, 1) == sorted(changes[1] + changes[2])
    step(model, [q], seed=9)
    publisher.publish(sent(model))
    state = store.state()
    assert mirror_chain(uri, 4, mirror, (state.run_id, state.version)) == [4]  # only what is new
    assert store.apply(mirror, 4) == [4] and _holds(store, model)
    with pytest.raises(DeltaVersionNotFound, match=r"version 5 is not published: no s3://"):
        mirror_chain(uri, 5, mirror, (state.run_id, 4))


def test_a_new_run_clears_the_bucket_and_a_half_upload_is_not_a_version(s3, tmp_path: Path) -> None:  # noqa: ANN001
    base = tmp_path / "base"
    model = tiny_model(base)
    uri = f"s3://{BUCKET}/run-b"
    first = DeltaPublisher(uri, base, staging_dir=tmp_path / "staging")
    for v in (1, 2):
        step(model, ["lm_head.weight"], seed=v)
        first.publish(sent(model))
    second = DeltaPublisher(uri, base)  # a temporary staging directory
    step(model, ["model.norm.weight"], seed=3)
    second.publish(sent(model))
    assert s3.ls(f"{BUCKET}/run-b/deltas") == [f"{BUCKET}/run-b/deltas/delta-00000001"]
    # payloads without a manifest (an upload cut short): not published
    s3.pipe(f"{BUCKET}/run-b/deltas/delta-00000002/payload-00000.bin", b"half")
    mirror = tmp_path / "mirror"
    with pytest.raises(DeltaVersionNotFound, match="version 2 is not published"):
        mirror_chain(uri, 2, mirror, ("", 0))
    # a mirror holding the first run's version 1 copies the second run's again
    stale = version_dir(mirror, 1)
    stale.mkdir(parents=True)
    (stale / MANIFEST).write_text('{"old": true}')
    assert mirror_chain(uri, 1, mirror, ("", 0)) == [1]
    store = DeltaStore(tmp_path / "store", base)
    assert store.apply(mirror, 1) == [1] and _holds(store, model)


def test_a_rebase_deletes_the_older_versions_from_the_bucket(s3, tmp_path: Path) -> None:  # noqa: ANN001
    base = tmp_path / "base"
    model = tiny_model(base)
    uri = f"s3://{BUCKET}/run-d"
    publisher = DeltaPublisher(uri, base, rebase_interval=3)
    listed = []
    for v in (1, 2, 3, 4):
        step(model, ["lm_head.weight"], seed=v)
        publisher.publish(sent(model))
        listed.append([p.rsplit("-", 1)[-1] for p in s3.ls(f"{BUCKET}/run-d/deltas", refresh=True)])
    assert listed == [["00000001"], ["00000001", "00000002"], ["00000003"], ["00000003", "00000004"]]
    store = DeltaStore(tmp_path / "store", base)
    mirror = tmp_path / "store" / MIRROR
    assert mirror_chain(uri, 4, mirror, ("", 0)) == [4, 3]  # back to the rebased version 3 only
    assert store.apply(mirror, 4) == [3, 4] and _holds(store, model)


def test_an_engine_fetches_and_loads_from_the_bucket(s3, tmp_path: Path) -> None:  # noqa: ANN001
    from test_delta_engines import Engine

    base = tmp_path / "base"
    model = tiny_model(base)
    uri = f"s3://{BUCKET}/run-c"
    publisher = DeltaPublisher(uri, base, max_file_bytes=64)  # a file per changed tensor
    engine = Engine("e0", base)
    changed = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    loop = asyncio.new_event_loop()
    try:
        for v in (1, 2):
            step(model, changed, seed=v)
            publisher.publish(sent(model))
        request = DeltaSyncRequest(2, uri, str(tmp_path / "store"), download_workers=2)
        receipt = loop.run_until_complete(engine.load_delta(request))
        assert receipt["applied_versions"] == [1, 2] and receipt["tensors"] == 2
        assert engine.fake.holds(model)
        mirrored = tmp_path / "store" / MIRROR
        assert all(sorted(p.name for p in version_dir(mirrored, v).iterdir()) == [MANIFEST] for v in (1, 2))
    finally:
        loop.close()


def test_a_bucket_that_does_not_answer_fails_naming_the_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()  # another test's endpoint
    with pytest.raises(DeltaError, match=r"reading the manifest of version 1 from s3://nowhere/run"):
        mirror_chain("s3://nowhere/run", 1, tmp_path / "mirror", ("", 0))
