"""Checkpoint-delta weight sync into the session's in-process vLLM engine (CPU): versions
published from a transformers copy of the tiny model, applied to a store and loaded by the
engine's worker, give the engine what a sync of the same weights over a weight-update group gives.

Run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/test_delta_sync_live.py'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from skylift.inference.local import LocalVLLMEngine
from skylift.weight_sync import WeightSender
from skylift.weight_sync.delta.publish import DeltaPublisher
from skylift.weight_sync.protocol import DeltaSyncRequest

pytestmark = pytest.mark.integration

SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]
TOLERANCE = 1e-4


def hf_logprobs(model: Any) -> list[list[float]]:
    out = []
    for tokens in SEQUENCES:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
        out.append([logp[i - 1, t].item() for i, t in enumerate(tokens) if i > 0])
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def perturb(model: Any, names: list[str] | None, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names is None or name in names:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def group_sync(loop: Any, engine: LocalVLLMEngine, weights: dict[str, torch.Tensor]) -> None:
    async def sync() -> None:
        sender = WeightSender(timeout_s=20.0)
        await sender.init_group([engine])
        try:
            await sender.send_state_dict(weights.items(), bucket_bytes=256 * 1024)
        finally:
            await sender.close()

    loop.run(sync())


def test_a_delta_sync_gives_the_engine_what_a_group_sync_gives(
    engine: LocalVLLMEngine, loop: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync = tmp_path / "sync"
    publisher = DeltaPublisher(sync, tiny_model_dir)

    def request(version: int) -> DeltaSyncRequest:
        return DeltaSyncRequest(version, str(sync), str(tmp_path / "store"))

    try:
        perturb(model, None, seed=1)  # version 1: every parameter
        assert publisher.publish(model.state_dict().items()).changed == len(list(model.parameters()))
        loop.run(engine.weight_call("delta", "load", request(1).to_dict()))
        assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), hf_logprobs(model)) <= TOLERANCE

        # version 2: one part of layer 0's fused q/k/v module and the final norm
        perturb(model, ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"], seed=2)
        stats = publisher.publish(model.state_dict().items())
        assert stats.changed == 2 and stats.compressed_bytes < stats.raw_bytes
        receipt = loop.run(engine.weight_call("delta", "load", request(2).to_dict()))
        assert receipt["tensors"] == 7  # q/k/v weights and biases loaded whole, and the norm
        assert receipt["prefix_cache_reset"]
        by_delta = [loop.run(engine.prompt_top_logprobs(s, 20)) for s in SEQUENCES]
        assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), hf_logprobs(model)) <= TOLERANCE

        group_sync(loop, engine, model.state_dict())  # the same weights over a weight-update group
        assert [loop.run(engine.prompt_top_logprobs(s, 20)) for s in SEQUENCES] == by_delta
    finally:
        group_sync(loop, engine, original)  # the session's engine gets the checkpoint back
