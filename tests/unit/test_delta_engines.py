"""Checkpoint-delta weight sync between the driver, the policy and engines, without vLLM: real
`LocalVLLMEngine`s (their delta calls, `inference.delta_engine`) over a fake vLLM whose worker
loads from the host's store, the `skylift serve` routes over one, and `EngineWeights` driving a
pool of them while a fake policy publishes real versions of a tiny model's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from delta_fakes import FakeVllm, sent, step, tiny_model
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skylift.cluster.engine_weights import EngineWeights
from skylift.config import load_config
from skylift.inference import delta_routes
from skylift.inference.allowed_paths import AllowedRoots
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.pool import EnginePool
from skylift.inference.types import EngineNotFoundError, EngineRequestError, EngineUnavailableError
from skylift.weight_sync.delta.format import read_manifest, version_dir
from skylift.weight_sync.delta.publish import DeltaPublisher
from skylift.weight_sync.protocol import DeltaPublishSpec, DeltaSyncRequest


class Engine(LocalVLLMEngine):
    """A local engine over `FakeVllm`; a dead one is unavailable."""

    def __init__(self, name: str, base: Path) -> None:
        self.fake = FakeVllm(base)
        super().__init__(
            self.fake, name=name, tensor_parallel_size=1, sleep_mode_enabled=False, model_path=str(base)
        )
        self.dead = False

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        if self.dead:
            raise EngineUnavailableError(f"{self.name} is gone")
        return await super().weight_call(transport, operation, payload)

    async def fetch_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self.weight_call("delta", "fetch", request.to_dict())

    async def load_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self.weight_call("delta", "load", request.to_dict())

    @property
    def delta(self) -> Any:
        return self.weights["delta"]


class Policy:
    """The policy's side of delta sync (`WorkerGroup.publish_delta`): rank 0's publisher."""

    def __init__(self, model: torch.nn.Module, base: Path) -> None:
        self.model, self.base = model, base
        self.publisher: DeltaPublisher | None = None
        self.calls: list[tuple] = []

    def publish_delta(self, spec: DeltaPublishSpec, dtype: str | None) -> dict[str, float]:
        self.calls.append(("publish", dtype))
        if self.publisher is None:
            self.publisher = DeltaPublisher(spec.sync_dir, self.base, spec.max_file_bytes, spec.num_workers)
        return self.publisher.publish(sent(self.model, getattr(torch, dtype or "float32"))).metrics()

    def close_weight_group(self) -> None:
        raise AssertionError("delta sync has no weight-update group")


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_an_engine_loads_only_what_changed_and_catches_up_on_missed_versions(
    tmp_path: Path, loop: Any
) -> None:
    base, sync = tmp_path / "base", tmp_path / "sync"
    model = tiny_model(base)
    publisher = DeltaPublisher(sync, base)
    engine = Engine("e0", base)
    request = lambda v: DeltaSyncRequest(v, str(sync), str(tmp_path / "store"))  # noqa: E731
    q, up = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    step(model, [q], seed=1)
    publisher.publish(sent(model))
    receipt = loop.run_until_complete(engine.load_delta(request(1)))
    assert engine.fake.loads == [[q]] and receipt["tensors"] == 1 and receipt["prefix_cache_reset"]
    assert engine.fake.holds(model)
    for v, names in ((2, [up]), (3, ["model.norm.weight"])):  # the engine is told of neither
        step(model, names, seed=v)
        publisher.publish(sent(model))
    loop.run_until_complete(engine.load_delta(request(3)))
    assert engine.fake.loads[-1] == sorted([up, "model.norm.weight"])  # v2's and v3's changes
    assert engine.fake.holds(model)
    # weights received over a weight-update group since: the next version loads every tensor
    engine.weights.state.version += 1
    step(model, [q], seed=5)
    publisher.publish(sent(model))
    loop.run_until_complete(engine.load_delta(request(4)))
    assert len(engine.fake.loads[-1]) == len(model.state_dict()) and engine.fake.holds(model)
    # a new run in the same sync_dir: the engine holds the old run's weights, so it loads them all
    publisher = DeltaPublisher(sync, base)
    step(model, [q], seed=4)
    publisher.publish(sent(model))
    loop.run_until_complete(engine.load_delta(request(1)))
    assert len(engine.fake.loads[-1]) == len(model.state_dict())
    assert engine.fake.holds(model)
    with pytest.raises(EngineNotFoundError, match="version 2 is not published"):
        loop.run_until_complete(engine.fetch_delta(request(2)))
    with pytest.raises(EngineRequestError, match="is not a directory on this engine's host"):
        loop.run_until_complete(engine.fetch_delta(DeltaSyncRequest(1, str(tmp_path / "nowhere"))))


def test_the_routes_answer_bad_requests_with_4xx_and_the_engine_keeps_its_weights(tmp_path: Path) -> None:
    base, sync = tmp_path / "base", tmp_path / "sync"
    model = tiny_model(base)
    publisher = DeltaPublisher(sync, base)
    engine = Engine("server", base)
    app = FastAPI()
    roots = AllowedRoots.from_flags([str(tmp_path), "gs://bucket"])
    app.state.skylift = type("State", (), {"engine": engine, "delta_roots": roots})()
    delta_routes.install(app)
    client = TestClient(app)
    step(model, ["lm_head.weight"], seed=1)
    publisher.publish(sent(model))
    body = {"version": 1, "sync_dir": str(sync), "local_checkpoint_dir": str(tmp_path / "store")}
    fetched = client.post("/skylift/delta/fetch", json=body)
    assert fetched.status_code == 200 and fetched.json()["applied_versions"] == [1]
    assert client.post("/skylift/delta/load", json=body).status_code == 200
    assert engine.fake.holds(model)
    version_1 = {name: tensor.clone() for name, tensor in sent(model)}
    step(model, ["model.norm.weight"], seed=2)
    publisher.publish(sent(model))
    record = read_manifest(sync, 2).tensors[0]
    payload = version_dir(sync, 2) / record.file
    payload.write_bytes(b"\0" * payload.stat().st_size)
    bad = {
        "version 7": ({**body, "version": 7}, 404, "version 7 is not published"),
        "no sync_dir": ({"version": 1}, 422, "sync_dir"),
        "not a dir": ({**body, "sync_dir": str(tmp_path / "nowhere")}, 400, "is not a directory"),
        "gcs without gcsfs": ({**body, "sync_dir": "gs://bucket/run"}, 409, "install gcsfs to reach gs://"),
        "version 0": ({**body, "version": 0}, 422, "version"),
        "corrupt": ({**body, "version": 2}, 400, f"payload {payload} is corrupt"),
        # paths come from the server's roots (--delta-sync-root), checked before anything is opened
        "4 KB sync_dir": ({**body, "sync_dir": "/" + "a" * 4000}, 400, "not a usable path"),
        "outside": ({**body, "sync_dir": str(tmp_path.parent)}, 403, f"allowed roots: {tmp_path.resolve()}"),
        "escape": (
            {**body, "local_checkpoint_dir": str(tmp_path / ".." / "elsewhere")},
            403,
            "not under an allowed",
        ),
        "other bucket": ({**body, "sync_dir": "s3://other/run"}, 403, "not under an allowed bucket prefix"),
    }
    for what, (wrong, status, words) in bad.items():
        answer = client.post("/skylift/delta/load", json=wrong)
        assert answer.status_code == status and words in answer.text, (what, answer.text)
    assert engine.delta.loaded[1] == 1 and len(engine.fake.loads) == 1  # still version 1, serving
    assert all(torch.equal(engine.fake.weights[n], t) for n, t in version_1.items())


def test_the_driver_publishes_then_every_live_engine_applies_and_loads(tmp_path: Path, loop: Any) -> None:
    base, sync = tmp_path / "base", tmp_path / "sync"
    model = tiny_model(base)
    policy = Policy(model, base)
    engines = [Engine("e0", base), Engine("e1", base)]  # one host: they share a store
    pool = EnginePool(engines)  # type: ignore[list-item]
    ie = "generator.inference_engine."
    cfg = load_config(
        [
            f"{ie}weight_sync_backend=delta",
            f"{ie}delta_weight_sync.sync_dir={sync}",
            f"{ie}delta_weight_sync.local_checkpoint_dir={tmp_path}/store",
            "generator.model_dtype=bfloat16",
        ]
    )
    said: list[str] = []
    weights = EngineWeights(cfg, policy, pool, loop.run_until_complete, said.append)  # type: ignore[arg-type]
    weights.open()
    assert said == [f"weight sync: delta versions under {sync}"] and policy.calls == []
    step(model, ["model.embed_tokens.weight"], seed=1)
    weights.sync(1)
    assert policy.calls == [("publish", "bfloat16")] and weights.version == 1
    assert all(e.fake.holds(model) and e.fake.loads == [["model.embed_tokens.weight"]] for e in engines)
    # engine 1 dies: the pool takes it out, engine 0 still gets the version
    engines[1].dead = True
    step(model, ["model.layers.1.self_attn.o_proj.weight"], seed=2)
    weights.sync(2)
    assert pool.live_indices == [0] and engines[0].fake.holds(model) and not engines[1].fake.holds(model)
    # requests in flight (fully async): the load is bracketed by pause and resume, labelled
    weights.pause_mode = "keep"
    step(model, ["model.norm.weight"], seed=3)
    weights.sync(3)
    assert engines[0].fake.loads[-4:] == [["pause keep"], ["model.norm.weight"], ["label 3"], ["resume"]]
    assert engines[0].fake.holds(model)
    # the last engine gone: the version is published, loaded by none, and the step goes on
    pool.mark_failed(0, "test")
    weights.sync(4)
    assert weights.version == 4 and "loaded by no engine" in said[-1]
    weights.close()


def test_a_server_without_delta_roots_refuses_every_path(tmp_path: Path) -> None:
    base = tmp_path / "base"
    tiny_model(base)
    app = FastAPI()
    app.state.skylift = type("State", (), {"engine": Engine("server", base), "delta_roots": AllowedRoots()})()
    delta_routes.install(app)
    answer = TestClient(app).post("/skylift/delta/fetch", json={"version": 1, "sync_dir": str(tmp_path)})
    assert answer.status_code == 403 and "--delta-sync-root DIR" in answer.text
    assert not (tmp_path / "store").exists()


def test_allowed_roots_resolve_symlinks_and_refuse_bad_roots(tmp_path: Path) -> None:
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    (inside / "link").symlink_to(outside)
    roots = AllowedRoots.from_flags([str(inside)])
    assert roots.check("sync_dir", str(inside / "run")) == str((inside / "run").resolve())
    with pytest.raises(ValueError, match="not under an allowed directory"):
        roots.check("sync_dir", str(inside / "link" / "run"))  # a symlink out of the root
    with pytest.raises(ValueError, match="not a directory on this host"):
        AllowedRoots.from_flags([str(tmp_path / "missing")])
