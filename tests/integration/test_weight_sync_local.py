"""Weight sync from a transformers model into a running in-process vLLM engine (gloo on CPU).

Run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/test_weight_sync_local.py'
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from skylift.inference.local import LocalVLLMEngine
from skylift.inference.types import EngineError, WeightBucket
from skylift.weight_sync import WeightSender, WeightSyncError

pytestmark = pytest.mark.integration

T = TypeVar("T")

SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]
TOLERANCE = 1e-4
GROUP_TIMEOUT_S = 20.0


@pytest.fixture
def hf_model(tiny_model_dir: Path) -> Any:
    """A fresh transformers copy of the tiny model (tests perturb it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def original_weights(engine: LocalVLLMEngine, loop: Any, hf_model: Any) -> Iterator[None]:
    """Put the checkpoint's weights back into the shared engine after the test."""
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield
    if loop.run(engine.weight_call("broadcast", "has_group")):
        loop.run(engine.weight_call("broadcast", "leave"))

    async def restore() -> None:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine])
        try:
            await sender.send_state_dict(original.items())
        finally:
            await sender.close()

    loop.run(restore())


def hf_token_logprobs(model: Any, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(tokens) if i > 0]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def perturb(model: Any, scale: float = 0.05, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)


def sync_weights(
    loop: Any, engine: LocalVLLMEngine, weights: list[tuple[str, torch.Tensor]], overlap: bool
) -> Any:
    """One sync of `weights` into `engine` over a fresh group (256 KB buckets), streamed or sequential."""

    async def sync() -> Any:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, overlap=overlap)
        await sender.init_group([engine])
        try:
            return await sender.send_state_dict(weights, bucket_bytes=256 * 1024)
        finally:
            await sender.close()

    return loop.run(sync())


def engine_view(loop: Any, engine: LocalVLLMEngine) -> list[Any]:
    """The engine's top-20 prompt logprobs of every test sequence: equal only for equal weights."""
    return [loop.run(engine.prompt_top_logprobs(s, 20)) for s in SEQUENCES]


def test_update_makes_engine_match_new_weights(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    before = loop.run(engine.prompt_logprobs(SEQUENCES))
    assert max_abs_diff(before, [hf_token_logprobs(hf_model, s) for s in SEQUENCES]) <= TOLERANCE

    perturb(hf_model)
    expected = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]
    assert max_abs_diff(before, expected) > 1e-2  # the perturbation is visible

    async def sync() -> Any:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine])
        assert await engine.weight_call("broadcast", "has_group")
        try:
            # small buckets: several round trips, each whole transformer blocks
            return await sender.send_state_dict(hf_model.state_dict().items(), bucket_bytes=256 * 1024)
        finally:
            await sender.close()

    stats = loop.run(sync())
    n_tensors = len(hf_model.state_dict())
    assert stats.buckets > 1 and stats.tensors == n_tensors
    assert stats.bytes == sum(t.numel() * t.element_size() for t in hf_model.state_dict().values())
    assert loop.run(engine.weight_call("broadcast", "has_group")) is False  # close() destroyed both sides

    after = loop.run(engine.prompt_logprobs(SEQUENCES))
    assert max_abs_diff(after, expected) <= TOLERANCE
    assert max_abs_diff(after, before) > 1e-2


def test_bfloat16_sender_tensors_are_loaded(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """Mixed dtypes on the wire: the engine casts to its own dtype when loading."""
    perturb(hf_model, seed=2)
    mixed = [(k, v.to(torch.bfloat16) if "mlp" in k else v) for k, v in hf_model.state_dict().items()]
    with torch.no_grad():  # the reference carries the same rounding
        for name, param in hf_model.named_parameters():
            if "mlp" in name:
                param.copy_(param.to(torch.bfloat16).float())
    expected = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]

    async def sync() -> None:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine])
        try:
            await sender.send_state_dict(mixed)
        finally:
            await sender.close()

    loop.run(sync())
    assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), expected) <= TOLERANCE


@pytest.mark.parametrize("direct_bytes", [None, 64 * 1024], ids=["default", "direct-64k"])
def test_overlapped_sync_is_bit_identical_to_sequential(
    engine: LocalVLLMEngine,
    loop: Any,
    hf_model: Any,
    original_weights: None,
    direct_bytes: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weight stream (one call, reload overlapping the next broadcast) leaves the engine with
    exactly the weights of the sequential path (one call and one reload per bucket): identical
    logprobs, to the bit, of the top 20 tokens at every position. `direct-64k`: the tiny model's
    tensors of 64 KB and more go on the wire as they are (`buckets.wire_pieces`; by default only
    tensors of 1 MB or more do, and the tiny model has none), received into slices of the arena."""
    if direct_bytes is not None:
        monkeypatch.setattr("skylift.weight_sync.buckets.DIRECT_BYTES", direct_bytes)
    original = list({k: v.clone() for k, v in hf_model.state_dict().items()}.items())
    perturb(hf_model, seed=4)
    state = [(k, v.to(torch.bfloat16) if "mlp" in k else v) for k, v in hf_model.state_dict().items()]

    sequential = sync_weights(loop, engine, state, overlap=False)
    assert not sequential.overlapped and sequential.buckets > 2
    after_sequential = engine_view(loop, engine)
    sync_weights(loop, engine, original, overlap=False)
    assert engine_view(loop, engine) != after_sequential  # the original weights are back
    version = engine.weight_version
    overlapped = sync_weights(loop, engine, state, overlap=True)
    assert overlapped.overlapped and (overlapped.buckets, overlapped.tensors, overlapped.bytes) == (
        sequential.buckets,
        sequential.tensors,
        sequential.bytes,
    )
    assert engine.weight_version == version + overlapped.buckets
    assert engine_view(loop, engine) == after_sequential


def test_stream_loads_directly_and_falls_back_to_vllms_reload(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """The stream loads every bucket of the tiny Qwen2 straight into its modules
    (`weight_sync.broadcast.direct_load`), to the bit what vLLM's reload (the sequential path) gives; a
    bucket with a tensor that path does not map (a rotary `inv_freq`, which vLLM's loader drops)
    hands it and the buckets after it to vLLM's reload, with the same result."""
    original = list({k: v.clone() for k, v in hf_model.state_dict().items()}.items())
    perturb(hf_model, seed=6)
    state = [(k, v.to(torch.bfloat16) if "mlp" in k else v) for k, v in hf_model.state_dict().items()]
    last = max(i for i, (k, _) in enumerate(state) if k.startswith("model.layers.1."))
    inv_freq = ("model.layers.1.self_attn.rotary_emb.inv_freq", torch.ones(8))
    with_unmapped = [*state[: last + 1], inv_freq, *state[last + 1 :]]

    sync_weights(loop, engine, state, overlap=False)
    reference = engine_view(loop, engine)
    sync_weights(loop, engine, original, overlap=False)
    assert engine_view(loop, engine) != reference
    direct = sync_weights(loop, engine, state, overlap=True)
    assert direct.overlapped and direct.buckets > 2
    assert direct.receipts[0]["direct_buckets"] == direct.buckets
    assert engine_view(loop, engine) == reference
    sync_weights(loop, engine, original, overlap=False)
    mixed = sync_weights(loop, engine, with_unmapped, overlap=True)
    assert 0 < mixed.receipts[0]["direct_buckets"] < mixed.buckets
    assert engine_view(loop, engine) == reference


@pytest.fixture
def bf16_engine(tiny_model_dir: Path, loop: Any) -> Iterator[LocalVLLMEngine]:
    """The tiny model in a bfloat16 engine (the demo's engine dtype: on CPUs with AMX vLLM packs its
    linear layers with the sgl kernels and keeps their biases in float32); closed after its one
    test, so that it never runs beside the session's engine longer than needed."""
    eng = loop.run(
        LocalVLLMEngine.create(
            str(tiny_model_dir),
            max_model_len=512,
            seed=0,
            dtype="bfloat16",
            max_num_seqs=4,
            enforce_eager=True,
        ),
        timeout_s=600.0,
    )
    yield eng
    loop.run(eng.close())


def test_direct_load_into_a_bfloat16_engine_is_bit_identical(
    bf16_engine: LocalVLLMEngine, loop: Any, hf_model: Any
) -> None:
    """The stream's direct load into a bfloat16 engine gives what vLLM's reload gives, to the bit."""
    engine = bf16_engine
    original = [(k, v.to(torch.bfloat16)) for k, v in hf_model.state_dict().items()]
    perturb(hf_model, seed=7)
    state = [(k, v.to(torch.bfloat16)) for k, v in hf_model.state_dict().items()]

    sync_weights(loop, engine, state, overlap=False)
    reference = engine_view(loop, engine)
    sync_weights(loop, engine, original, overlap=False)
    assert engine_view(loop, engine) != reference
    direct = sync_weights(loop, engine, state, overlap=True)
    assert direct.receipts[0]["direct_buckets"] == direct.buckets > 2
    assert engine_view(loop, engine) == reference


def test_requests_during_a_stream_see_old_or_new_weights_only(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """Requests scored while a weight stream is loading bucket after bucket come out of the old
    model or of the new one, never of a mix (the engine core runs no step during the one call)."""
    import asyncio

    old = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]
    perturb(hf_model, seed=5)
    new = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]
    state = list(hf_model.state_dict().items())

    async def run() -> tuple[Any, list[list[float]]]:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine])
        done = asyncio.Event()
        seen: list[list[float]] = []

        async def probe(seq: list[int]) -> None:
            while not done.is_set():
                seen.append((await engine.prompt_logprobs([seq]))[0])

        probes = [asyncio.create_task(probe(s)) for s in SEQUENCES for _ in range(2)]
        try:
            while len(seen) < 2:  # the old model answered before the sync
                await asyncio.sleep(0.01)
            stats = await sender.send_state_dict(state, bucket_bytes=256 * 1024)
            after = len(seen) + len(probes)
            while len(seen) <= after:  # and the new one after it
                await asyncio.sleep(0.01)
        finally:
            done.set()
            await asyncio.gather(*probes)
            await sender.close()
        return stats, seen

    stats, seen = loop.run(run())
    assert stats.overlapped and stats.buckets > 2
    kinds = []
    for lp in seen:
        i = 0 if len(lp) == len(old[0]) else 1
        d_old, d_new = max_abs_diff([lp], [old[i]]), max_abs_diff([lp], [new[i]])
        assert min(d_old, d_new) <= TOLERANCE, f"a request saw neither model ({d_old=:.3g}, {d_new=:.3g})"
        kinds.append(d_new <= TOLERANCE)
    assert not kinds[0] and kinds[-1]


def test_second_group_needs_override(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """A server that outlives a trainer run accepts a new group only with override_existing."""
    first = WeightSender(timeout_s=GROUP_TIMEOUT_S)
    loop.run(first.init_group([engine]))  # then the "trainer" goes away without closing

    refused = WeightSender(timeout_s=5.0)
    with pytest.raises(WeightSyncError, match="engine 0 .*already exists.*override_existing=True"):
        loop.run(refused.init_group([engine], override_existing=False))

    perturb(hf_model, seed=3)
    expected = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]

    async def second_run() -> None:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine], override_existing=True)
        try:
            await sender.send_state_dict(hf_model.state_dict().items())
        finally:
            await sender.close()

    loop.run(second_run())
    assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), expected) <= TOLERANCE
    first.group.destroy()  # type: ignore[union-attr]


def test_tensors_transport_pushes_the_tensors_put_into_its_engine(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """The Tinker sampler's transport: tensors put, then pushed as a version, over a group it hosts."""
    from skylift.weight_sync.broadcast.tensors import TensorsTransport

    if loop.run(engine.weight_call("broadcast", "has_group")):
        loop.run(engine.weight_call("broadcast", "leave"))
    perturb(hf_model, seed=4)
    expected = [hf_token_logprobs(hf_model, s) for s in SEQUENCES]
    transport = TensorsTransport([engine], WeightSender(timeout_s=GROUP_TIMEOUT_S))

    async def push() -> dict[str, float]:
        assert "1 engine(s)" in await transport.open()
        try:
            with pytest.raises(RuntimeError, match="push before put"):
                await transport.push(1)
            transport.put(hf_model.state_dict())
            return await transport.push(1)
        finally:
            await transport.close()

    metrics = loop.run(push())
    assert metrics["weight_sync/bytes"] > 0 and transport.version == 1 and transport.staged is None
    assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), expected) <= TOLERANCE


def test_update_without_group_is_a_clear_error(engine: LocalVLLMEngine, loop: Any) -> None:
    if loop.run(engine.weight_call("broadcast", "has_group")):
        loop.run(engine.weight_call("broadcast", "leave"))
    bucket = WeightBucket(names=["model.norm.weight"], dtypes=["float32"], shapes=[[128]])
    with pytest.raises(EngineError, match="no weight-update group"):
        loop.run(engine.weight_call("broadcast", "bucket", bucket.to_dict()))
    with pytest.raises(WeightSyncError, match="init_group"):
        loop.run(WeightSender().send_state_dict([("model.norm.weight", torch.zeros(128))]))


def test_partial_fused_module_is_refused(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any, original_weights: None
) -> None:
    """q_proj alone would leave k/v of vLLM's fused qkv_proj uninitialised: refused, nothing loaded."""
    before = loop.run(engine.prompt_logprobs(SEQUENCES))
    name = "model.layers.0.self_attn.q_proj.weight"

    async def send_part() -> None:
        sender = WeightSender(timeout_s=GROUP_TIMEOUT_S)
        await sender.init_group([engine])
        try:
            await sender.send_state_dict([(name, hf_model.state_dict()[name] + 1.0)])
        finally:
            await sender.close()

    with pytest.raises(WeightSyncError, match="engine 0 .*qkv_proj"):
        loop.run(send_part())
    assert max_abs_diff(loop.run(engine.prompt_logprobs(SEQUENCES)), before) == 0.0


def test_process_group_broadcasts_between_two_ranks(loopback_only: None) -> None:
    """The group primitive alone: two ranks in threads, gloo over loopback, both dtypes."""
    from concurrent.futures import ThreadPoolExecutor

    from skylift.weight_sync.process_group import create_weight_sync_group, find_free_port

    port = find_free_port()

    def member(rank: int) -> list[torch.Tensor]:
        group = create_weight_sync_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=2,
            group_name="two_ranks",
            backend="gloo",
            timeout_s=GROUP_TIMEOUT_S,
        )
        try:
            tensors = [torch.arange(6, dtype=torch.float32), torch.arange(3).to(torch.bfloat16)]
            if rank == 1:
                tensors = [torch.zeros_like(t) for t in tensors]
            for t in tensors:
                group.broadcast(t, src=0)
            return tensors
        finally:
            group.destroy()

    with ThreadPoolExecutor(2) as pool:
        sent, received = pool.map(member, [0, 1])
    for a, b in zip(sent, received, strict=True):
        assert torch.equal(a, b)


def test_process_group_rendezvous_times_out_clearly(loopback_only: None) -> None:
    from skylift.weight_sync.process_group import create_weight_sync_group, find_free_port

    port = find_free_port()
    with pytest.raises(WeightSyncError, match=f"group 'lonely' at 127.0.0.1:{port} as rank 0/2"):
        create_weight_sync_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="lonely",
            backend="gloo",
            timeout_s=2.0,
        )
