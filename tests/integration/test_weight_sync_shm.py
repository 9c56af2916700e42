"""Full weights by shared-memory handle into the shared in-process vLLM engine
(`weight_sync.ipc`: the CPU form of the same-GPU CUDA IPC path), against the gloo broadcast.

Run inside a loopback-only namespace (the gloo side), under the heavy lock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from skylift.inference.local import LocalVLLMEngine
from skylift.inference.types import EngineRequestError, EngineStateError
from skylift.weight_sync import WeightSender
from skylift.weight_sync.ipc.handles import handle_to_wire, share_tensors
from skylift.weight_sync.ipc.transport import SharedTensorsTransport

pytestmark = pytest.mark.integration

SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


def by_gloo(loop: Any, engine: LocalVLLMEngine, state: dict[str, torch.Tensor]) -> None:
    async def sync() -> None:
        sender = WeightSender(timeout_s=20.0)
        await sender.init_group([engine], override_existing=True)
        try:
            await sender.send_state_dict(state.items())
        finally:
            await sender.close()

    loop.run(sync())


def test_logprobs_after_a_shared_memory_sync_equal_those_after_a_gloo_sync(
    engine: LocalVLLMEngine, loop: Any, tiny_model_dir: Path
) -> None:
    from safetensors.torch import load_file

    original: dict[str, torch.Tensor] = {}
    for shard in sorted(tiny_model_dir.glob("*.safetensors")):
        original.update(load_file(str(shard)))
    one, two = perturbed(tiny_model_dir, seed=11), perturbed(tiny_model_dir, seed=12)
    try:
        by_gloo(loop, engine, one)
        after_gloo = loop.run(engine.prompt_logprobs(SEQUENCES))
        by_gloo(loop, engine, two)  # something else in between
        assert loop.run(engine.prompt_logprobs(SEQUENCES)) != after_gloo
        version = engine.weight_version
        transport = SharedTensorsTransport([engine])
        assert "by handle" in loop.run(transport.open())
        transport.put(one)
        metrics = loop.run(transport.push(1))
        assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in one.values())
        assert loop.run(engine.prompt_logprobs(SEQUENCES)) == after_gloo  # bit for bit
        assert engine.weight_version == version + 1 and transport.version == 1
        with pytest.raises(RuntimeError, match="push before put"):
            loop.run(transport.push(2))
        loop.run(transport.close())
        # a bad handle is refused before any worker is asked; the engine keeps serving
        with pytest.raises(EngineRequestError, match="not a shared-tensors handle"):
            loop.run(engine.weight_call("ipc", "load", {"handle": {"buffers": "x"}}))
        # half of a fused module (q without k and v) is refused by the workers: nothing loaded
        part = share_tensors(
            {"model.layers.0.self_attn.q_proj.weight": two["model.layers.0.self_attn.q_proj.weight"]}
        )
        with pytest.raises(EngineStateError, match="loads together"):
            loop.run(engine.weight_call("ipc", "load", {"handle": handle_to_wire(part)}))
        part.release()
        assert loop.run(engine.prompt_logprobs(SEQUENCES)) == after_gloo
    finally:
        transport = SharedTensorsTransport([engine])
        transport.put(original)
        loop.run(transport.push(0))
        loop.run(transport.close())


def test_kept_buffers_streamed_while_the_sender_fills_load_what_a_gloo_sync_loads(
    engine: LocalVLLMEngine, loop: Any, tiny_model_dir: Path
) -> None:
    """Pushes into kept buffers, streamed bucket by bucket (1 MiB buckets: 4 of them) with the
    sender's fill held back, so the workers are called before any bucket is in: each must wait for
    the fill counter (before the fix the engine side dropped it, and the workers loaded the
    previous push's weights)."""
    from safetensors.torch import load_file

    original: dict[str, torch.Tensor] = {}
    for shard in sorted(tiny_model_dir.glob("*.safetensors")):
        original.update(load_file(str(shard)))
    one, two = perturbed(tiny_model_dir, seed=21), perturbed(tiny_model_dir, seed=22)
    by_gloo(loop, engine, one)
    after_one = loop.run(engine.prompt_logprobs(SEQUENCES))
    by_gloo(loop, engine, two)
    after_two = loop.run(engine.prompt_logprobs(SEQUENCES))
    transport = SharedTensorsTransport([engine], keep_buffers=True, bucket_bytes=1 << 20)
    fill = transport._fill

    def held_back(handle: Any, buckets: Any, counter: torch.Tensor) -> None:
        time.sleep(0.5)
        fill(handle, buckets, counter)

    transport._fill = held_back  # type: ignore[method-assign]
    try:
        for version, (state, expected) in enumerate([(one, after_one), (two, after_two), (one, after_one)]):
            transport.put(state)
            loop.run(transport.push(version))
            assert loop.run(engine.prompt_logprobs(SEQUENCES)) == expected, f"push {version}"
    finally:
        transport._fill = fill  # type: ignore[method-assign]
        transport.put(original)
        loop.run(transport.push(9))
        loop.run(transport.close())


def test_a_training_policys_shared_memory_sync_loads_what_its_gloo_broadcast_loads(
    engine: LocalVLLMEngine, loop: Any, tiny_model_dir: Path
) -> None:
    """`skylift train`'s full-weight transport (`make_transport`, weight_sync_backend=ipc) with the
    policy's rank in this process and the engine on this host: rank 0 and the engine's worker say
    where they run, the check lets shared memory through; both pushes stream into the kept buffers
    (laid out from the weights' layout before the first); after each, the engine's logprobs equal those after a gloo
    broadcast of the same policy, bit for bit."""
    from skylift.cluster.worker_group import WorkerGroup
    from skylift.config import load_config
    from skylift.inference.pool import EnginePool
    from skylift.weight_sync.broadcast.transport import BroadcastTransport
    from skylift.weight_sync.factory import make_transport
    from skylift.worker.training_worker import WorkerSettings

    original = perturbed(tiny_model_dir, seed=0)  # noise 0.05 x N(0, 1) with seed 0: not the engine's
    group = WorkerGroup("policy", WorkerSettings(model_path=str(tiny_model_dir)), use_ray=False)
    group.setup()
    pool = EnginePool([engine])
    said: list[str] = []
    shm = make_transport(load_config(["generator.weight_sync_backend=ipc"]), group, pool, said.append)
    gloo = BroadcastTransport(
        group,
        pool,
        said.append,
        backend="gloo",
        timeout_s=60.0,
        master_address="127.0.0.1",
        override_existing=True,
    )
    reset = SharedTensorsTransport([engine])
    try:
        line = loop.run(shm.open())
        assert "[ipc: forced by generator.weight_sync_backend]" in line and "by handle" in line, line
        loop.run(gloo.open())
        for version, seed in ((1, 31), (2, 32)):
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param in group.workers[0]._model().parameters():
                    param.add_(torch.randn(param.shape, generator=gen) * 0.05)
            metrics = loop.run(shm.push(version))
            # on CPU every push streams, the first into buffers laid out before the gather
            assert metrics["weight_sync/streamed"] == 1.0 and metrics["weight_sync/engines"] == 1
            after_shm = loop.run(engine.prompt_logprobs(SEQUENCES))
            reset.put(original)
            loop.run(reset.push(0))
            assert loop.run(engine.prompt_logprobs(SEQUENCES)) != after_shm
            loop.run(gloo.push(version))
            assert loop.run(engine.prompt_logprobs(SEQUENCES)) == after_shm, f"push {version}"
    finally:
        loop.run(gloo.close())
        loop.run(shm.close())
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(tiny_model_dir.glob("*.safetensors")):
            weights.update(load_file(str(shard)))
        reset.put(weights)
        loop.run(reset.push(0))
        loop.run(reset.close())
        group.shutdown()
