"""Fully async over HTTP: the server's `/skylift/pause` and `/skylift/resume` routes on the shared
tiny-model server. A request in flight while the engine pauses (mode keep), receives new
weights and resumes keeps going; its tokens carry both policy versions, and afterwards the
server's logprobs are the new weights'."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from skylift.inference.remote import RemoteInferenceEngine
from skylift.inference.types import SamplingParams
from skylift.weight_sync import WeightSender

pytestmark = pytest.mark.integration

SEQUENCE = [5, 17, 230, 999, 42, 8, 77, 301, 12, 64]
LONG = SamplingParams(max_tokens=500, ignore_eos=True, temperature=1.0, seed=5)


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, seq: list[int]) -> list[float]:
    ids = torch.tensor([seq])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(1, ids[0, 1:, None])[:, 0].tolist()


def test_server_pause_keep_with_a_request_in_flight(tiny_server_url: str, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert _post(tiny_server_url + "/skylift/pause", {"mode": "wait"}) == 400
    assert _post(tiny_server_url + "/skylift/resume", {"policy_version": -1}) == 400
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    moved = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    engine = RemoteInferenceEngine(tiny_server_url)

    async def go() -> tuple[list[int] | None, list[float]]:
        sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
        await sender.init_group([engine], master_address="127.0.0.1", backend="gloo", override_existing=True)
        try:
            await engine.resume_generation(policy_version=10)
            request = asyncio.create_task(engine.generate([SEQUENCE[:4]], LONG))
            await asyncio.sleep(0.1)  # some tokens before the pause (a fast machine makes 500 in ~0.5 s)
            assert not request.done(), "the request finished before the pause: make it longer"
            await engine.pause_generation("keep")
            await sender.send_state_dict(moved)
            await engine.reset_prefix_cache()
            await engine.resume_generation(policy_version=11)
            completion = (await request)[0].completions[0]
            assert len(completion.token_ids) == LONG.max_tokens and completion.stop_reason == "length"
            served = await engine.prompt_logprobs([SEQUENCE])
            await sender.send_state_dict(original)  # the shared server gets its weights back
            return completion.token_versions, served[0]
        finally:
            await sender.close()
            await engine.close()

    versions, served = asyncio.run(go())
    assert versions is not None and versions[0] == 10 and versions[-1] == 11 and sorted(versions) == versions
    expected = _logprobs(model, SEQUENCE)
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-3
