"""SIGKILL the Tinker server with operations in flight, restart it on the same database (PostgreSQL
here) and data directory: the SDK client's pending sample calls complete by resubmission (their
futures answer 410, on which the SDK sends them again), a lost training operation answers 410, and
no model or checkpoint record is lost; users stay apart after the restart.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from lab_helpers import Lab, fb_body, postgres_cluster, write_keys
from server_helpers import TINY_SERVED_NAME, TinkerServer, require_loopback_namespace
from tinker import types
from tinker_helpers import sft_dataset

from skylift.tinker.storage.db.local_postgres import LocalPostgres

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {"alice": "tml-restart-alice", "bob": "tml-restart-bob"}


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    yield from postgres_cluster()


def _sigkill(server: TinkerServer) -> None:
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)  # the server and its engine's processes
    server.process.wait(timeout=30)
    server.process = None


def test_sigkill_with_samples_in_flight_then_restart(tmp_path: Path, postgres: LocalPostgres) -> None:
    require_loopback_namespace()
    write_keys(tmp_path / "keys.txt", KEYS)
    server = TinkerServer(
        data_dir=tmp_path / "data",
        log_path=tmp_path / "server.log",
        extra_args=[
            "--database-url",
            postgres.url,
            "--api-keys-file",
            str(tmp_path / "keys.txt"),
            "--long-poll",
            "5",
        ],
    )
    server.start()
    try:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEYS["alice"])
        tc = client.create_lora_training_client(base_model=TINY_SERVED_NAME, rank=4).result()
        data = sft_dataset()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("before-kill").result().path
        sampler_path = tc.save_weights_for_sampler("before-kill").result().path
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        prompt = types.ModelInput.from_ints([5, 6, 7, 8])
        pending = [
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=i, temperature=1.0))
            for i in range(3)
        ]
        lab = Lab(server.url, KEYS)
        deadline = time.monotonic() + 120
        while server.status({"X-API-Key": KEYS["alice"]})["engine_start_attempts"] < 1:
            assert time.monotonic() < deadline, "the samples never started the engine"
            time.sleep(0.2)
        # a training operation waiting in its model's queue (its predecessor seq ids never come)
        in_flight = lab.post("alice", "forward_backward", fb_body(tc.model_id, seq_id=10**6)).json()[
            "request_id"
        ]
        _sigkill(server)

        server.start(port=int(lab.url.rsplit(":", 1)[1]))  # same address, database and data directory
        found = re.search(r"(\d+) requests were pending when the server last stopped", server.log_tail(400))
        # the training operation and at least one of the 3 samples (under load the SDK may still be
        # sending the others when the server dies; it resubmits those like the rest)
        assert found and int(found.group(1)) >= 2, server.log_tail()
        lost = lab.post("alice", "retrieve_future", {"request_id": in_flight})
        assert lost.status_code == 410 and "lost in a server restart" in lost.json()["error"], lost.text
        assert lab.post("bob", "retrieve_future", {"request_id": in_flight}).status_code == 404

        results = [f.result(timeout=600) for f in pending]  # resubmitted by the SDK after the 410
        assert all(len(r.sequences) == 1 and len(r.sequences[0].tokens) >= 1 for r in results)

        rest = tinker.RestClient(base_url=server.url, api_key=KEYS["alice"])
        paths = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert paths == {state, sampler_path}
        assert tc.model_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        bob = tinker.RestClient(base_url=server.url, api_key=KEYS["bob"])
        assert bob.list_training_runs().result().training_runs == []
        resumed = client.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.forward(data[:1], "cross_entropy").result().loss_fn_outputs
        client.close("success").result(timeout=60)
    finally:
        server.stop()
