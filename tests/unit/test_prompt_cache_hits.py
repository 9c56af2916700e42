"""Prompt prefix-cache hits from vLLM's final `RequestOutput` to the SDK's
`SampleResponse.prompt_cache_hit_tokens`: the engine's output, the HTTP route's JSON and the
Tinker sampler's protobuf (no engine started; the real engine's count: tests/tinker)."""

from __future__ import annotations

import json

import pytest
from tinker.proto.response_conv import deserialize_sample_response
from vllm.outputs import CompletionOutput, RequestOutput

from skylift.inference.codec import output_from_json, output_to_json
from skylift.inference.vllm_io import to_generate_output
from skylift.tinker.core.wire import SampledSequenceData, encode_sample_response

PROMPT = list(range(40))


def _final(cached: int | None, n: int = 2) -> RequestOutput:
    outs = [
        CompletionOutput(index=i, text="", token_ids=[7, 8], cumulative_logprob=None, logprobs=None)
        for i in reversed(range(n))
    ]
    for out in outs:
        out.finish_reason = "length"
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=PROMPT,
        prompt_logprobs=None,
        outputs=outs,
        finished=True,
        num_cached_tokens=cached,
    )


@pytest.mark.parametrize(("cached", "expected"), [(32, 32), (0, 0), (None, 0)])
def test_the_engine_output_carries_vllms_count_once_per_prompt(cached: int | None, expected: int) -> None:
    out = to_generate_output(_final(cached, n=2), PROMPT, want_logprobs=False)
    assert out.prompt_cached_tokens == expected  # two samples share the prompt: not doubled
    assert [c.stop_reason for c in out.completions] == ["length", "length"]
    assert output_from_json(json.loads(json.dumps(output_to_json(out)))).prompt_cached_tokens == expected


def test_json_from_an_engine_without_the_field_reads_as_zero() -> None:
    data = output_to_json(to_generate_output(_final(16), PROMPT, want_logprobs=False))
    del data["prompt_cached_tokens"]
    assert output_from_json(data).prompt_cached_tokens == 0


def test_the_sdk_reads_the_count_from_the_sample_response() -> None:
    seqs = [SampledSequenceData(tokens=[7, 8], logprobs=None, stop_reason="length")] * 2
    assert deserialize_sample_response(encode_sample_response(seqs, None)).prompt_cache_hit_tokens == 0
    res = deserialize_sample_response(encode_sample_response(seqs, None, prompt_cache_hit_tokens=32))
    assert res.prompt_cache_hit_tokens == 32 and len(res.sequences) == 2
