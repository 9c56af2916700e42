"""Tinker over a mixture-of-experts base (`tiny-qwen3-moe`: 8 experts routed top-2), driven by the
real SDK. A LoRA client with the SDK's default lora config (attention, MLP, unembedding) adapts the
fused experts too (PEFT's ``target_parameters``: one rank-r block per expert), its loss goes down,
and its samplers, served by weight swaps (vLLM's LoRA on fused experts needs Triton), score a
sequence as its training forward does: the adapter merged on the trainer, experts included, and
pushed under the checkpoint's per-expert names. A full fine-tune (rank 0) does the same.
``--sampler-lora adapters`` is refused at start in one line, before anything is on disk.

One server of its own (the shared one serves the dense tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from server_helpers import TinkerServer, free_port, require_loopback_namespace
from tinker import types
from tinker_helpers import logprobs_of, sft_dataset

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
MODEL = "tiny-qwen3-moe"
TOLERANCE = 1e-3  # the SDK tests' teacher-forced tolerance (fp32, merged weights)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    require_loopback_namespace()
    tmp: Path = tmp_path_factory.mktemp("tinker-moe")
    with TinkerServer(
        data_dir=tmp / "data",
        log_path=tmp / "server.log",
        base_model=MODEL,
        extra_args=["--max-model-len", "256", "--log-level", "info"],  # the create-time lines
    ) as server:
        yield server


def _engine_stats(server: TinkerServer) -> dict[str, Any]:
    req = urllib.request.Request(f"{server.url}/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read())["sampling"]["engines"][0])


def _gap(sampler: Any, sequence: types.ModelInput, trained: np.ndarray) -> float:
    engine = sampler.compute_logprobs(sequence).result()
    assert engine[0] is None and len(engine) == len(trained) + 1
    return float(np.abs(np.asarray(engine[1:], dtype=float) - trained).max())


def test_lora_and_full_fine_tuning_over_an_moe_base(moe_server: TinkerServer) -> None:
    service = tinker.ServiceClient(base_url=moe_server.url, api_key=API_KEY)
    try:
        data = sft_dataset()
        probe = data[0]
        sequence = types.ModelInput.from_ints(
            probe.model_input.to_ints() + [int(probe.loss_fn_inputs["target_tokens"].data[-1])]
        )
        lora = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
        losses = []
        for _ in range(4):
            fb = lora.forward_backward(data, "cross_entropy")
            lora.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses
        log = moe_server.log_path.read_text()
        assert "fused down_proj at rank 8 and gate_up_proj at rank 16 per expert" in log
        assert "routers are not adapted" in log and "by weight swaps" in log

        trained = logprobs_of(lora.forward([probe], "cross_entropy").result())
        base = service.create_sampling_client(base_model=MODEL).result()
        moved = _gap(base, sequence, trained)
        assert moved > 0.1, moved  # training moved these scores: the checks below mean something
        sampler = lora.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, seed=1)
        sampled = sampler.sample(probe.model_input, num_samples=2, sampling_params=params).result()
        assert [len(s.tokens) >= 1 for s in sampled.sequences] == [True, True]
        ephemeral = _gap(sampler, sequence, trained)
        named_path = lora.save_weights_for_sampler("moe-1").result().path
        named = _gap(service.create_sampling_client(model_path=named_path).result(), sequence, trained)
        print(
            f"\ntinker on {MODEL}: LoRA loss {losses[0]:.2f} -> {losses[-1]:.2f}; |engine - trainer| "
            f"{ephemeral:.1e} (ephemeral), {named:.1e} (named) vs {moved:.2f} from the base"
        )
        assert ephemeral <= TOLERANCE and named <= TOLERANCE, (ephemeral, named)
        stats = _engine_stats(moe_server)
        assert stats["mode"] == "swap" and "mixture-of-experts" in stats["reason"], stats

        full = service.create_lora_training_client(base_model=MODEL, rank=0).result()
        full.forward_backward(data, "cross_entropy").result()
        full.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        full_trained = logprobs_of(full.forward([probe], "cross_entropy").result())
        full_gap = _gap(full.save_weights_and_get_sampling_client().result(), sequence, full_trained)
        print(f"full fine-tune: |engine - trainer| {full_gap:.1e}")
        assert full_gap <= TOLERANCE
    finally:
        service.close("success").result(timeout=60)


def test_adapters_in_the_batch_are_refused_at_start(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "skylift.tinker.commands", "serve", "--base-model", MODEL]
    data = tmp_path / "data"
    cmd += ["--sampler-lora", "adapters", "--port", str(free_port()), "--data-dir", str(data)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and not data.exists()  # refused before the data dir and its database
    said = [line for line in done.stderr.splitlines() if "refused" in line]
    assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert said[0].startswith("refused: --sampler-lora adapters with tiny-qwen3-moe, a mixture-of-experts")
    assert "--sampler-lora swap or auto" in said[0]
