"""SDK 0.38 features through the real client: top-k and target prompt logprobs, top-k sample
logprobs, 2-D cross-entropy targets, stable_reinforce with provenance, gspo and dro, and ephemeral
samplers that stay usable however many newer ones a session makes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.tensor_data import TensorData
from tinker_helpers import datum, logprobs_of, sft_dataset

pytestmark = pytest.mark.integration

PROMPT = [5, 8, 11, 14, 17, 20, 23]


@pytest.fixture(scope="module")
def trained(tinker_server):
    service = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-dummy")
    tc = service.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()
    tc.forward_backward(sft_dataset(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    yield service, tc
    service.close("success").result(timeout=60)


def test_topk_and_target_prompt_logprobs(trained) -> None:
    _, tc = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    n = len(PROMPT)
    targets = np.stack([np.array(PROMPT[1:]), np.full(n - 1, 3)], axis=1).astype(np.int64)
    targets[2, 1] = -1  # asks nothing: 0.0 in the answer
    res = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=3),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
        topk_sample_logprobs=3,
        target_prompt_logprobs=TensorData.from_numpy(targets),
    ).result()
    plp = res.prompt_logprobs
    top = res.topk_prompt_logprobs
    assert plp[0] is None and top[0] is None and len(top) == n
    for i in range(1, n):
        values = [lp for _, lp in top[i]]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert plp[i] <= values[0] + 1e-6
        ranked = dict(top[i])
        if PROMPT[i] in ranked:
            assert ranked[PROMPT[i]] == pytest.approx(plp[i], abs=1e-5)
    target = res.target_prompt_logprobs.to_numpy()
    assert target.shape == (n - 1, 2) and target[2, 1] == 0.0
    np.testing.assert_allclose(target[:, 0], np.array(plp[1:]), atol=1e-5)  # the prompt's own tokens
    # the engine's logprobs of the targets agree with the trainer's for the same weights
    fwd = tc.forward([datum([*PROMPT[:-1], 3], weights=None)], "cross_entropy").result()
    lp = logprobs_of(fwd)  # logp(token i+1 | prompt[: i + 1]) with the last target 3
    assert target[-1, 1] == pytest.approx(lp[-1], abs=2e-3)
    for seq in res.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for tok, lp_tok, tops in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert len(tops) == 3 and lp_tok <= tops[0][1] + 1e-6
            if tok in dict(tops):
                assert dict(tops)[tok] == pytest.approx(lp_tok, abs=1e-5)


def test_top_k_above_the_cap_is_a_clear_400(trained) -> None:
    _, tc = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="above this server's cap of 20"):
        sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=2),
            topk_sample_logprobs=21,
        ).result()


def test_two_d_cross_entropy_targets(trained) -> None:
    _, tc = trained
    tokens = [5 + (j * 5) % 37 for j in range(12)]
    first = logprobs_of(tc.forward([datum(tokens)], "cross_entropy").result())
    second = logprobs_of(tc.forward([datum([*tokens[:-1], 9])], "cross_entropy").result())
    targets = np.stack([np.array(tokens[1:]), np.array(tokens[2:] + [9])], axis=1)
    weights = np.tile(np.array([[1.0, 0.5]], dtype=np.float32), (len(tokens) - 1, 1))
    two_d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": targets.astype(np.int64), "weights": weights},
    )
    out = tc.forward([two_d], "cross_entropy").result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].data).reshape(len(tokens) - 1, 2)
    np.testing.assert_allclose(lp[:, 0], first, atol=1e-5)
    assert lp[-1, 1] == pytest.approx(second[-1], abs=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(lp * weights).sum()), rel=1e-4)


def _provenance_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    ob_len = len(prompt) - 1
    model_input = types.ModelInput.from_ints(prompt + seq.tokens[:-1])
    n = model_input.length
    d = types.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": TensorData.from_torch(torch.tensor([0] * ob_len + seq.tokens)),
            "logprobs": TensorData.from_torch(torch.tensor([0.0] * ob_len + seq.logprobs)),
            "advantages": TensorData.from_torch(torch.tensor([0.0] * ob_len + [advantage] * (n - ob_len))),
        },
    )
    return d.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob_len),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
        ],
    )


def test_stable_reinforce_gspo_and_dro(trained) -> None:
    _, tc = trained
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=6, stop=[], temperature=1.0, seed=1)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params).result()
    data = [_provenance_datum(PROMPT, s, a) for s, a in zip(res.sequences, (1.0, -1.0), strict=True)]
    out = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"kl_coeff": 0.1}).result()
    # on-policy: every recorded ratio is ~1, so the loss is -sum(A * logp) over sampled tokens
    expected = 0.0
    for d, s, a in zip(out.loss_fn_outputs, res.sequences, (1.0, -1.0), strict=True):
        sampled = np.asarray(d["logprobs"].data)[len(PROMPT) - 1 :]
        np.testing.assert_allclose(sampled, s.logprobs, atol=2e-3)
        expected += -a * float(sampled.sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-2, abs=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    unrecorded = tc.save_weights_and_get_sampling_client().result()
    plain = unrecorded.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params
    ).result()
    with pytest.raises(Exception, match="no stability record"):
        tc.forward([_provenance_datum(PROMPT, plain.sequences[0], 1.0)], "stable_reinforce").result()
    with pytest.raises(Exception, match="needs provenance"):
        tc.forward(
            [datum(PROMPT, logprobs=np.zeros(6, np.float32), advantages=np.ones(6, np.float32))],
            "stable_reinforce",
        ).result()

    for loss, config in (("gspo", {"clip_high_threshold": 1.5}), ("dro", {"beta": 0.1})):
        fwd = tc.forward(data, loss, loss_fn_config=config).result()
        assert math.isfinite(fwd.metrics["loss:sum"])

    # The server remembers the sampling parameters of recorded sequences: the losses score tokens
    # sampled with top-p/top-k under the truncated distribution without loss_fn_config keys.
    recording = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    cut = types.SamplingParams(max_tokens=6, stop=[], temperature=0.9, top_p=0.7, top_k=20, seed=2)
    seq = recording.sample(types.ModelInput.from_ints(PROMPT), 1, cut).result().sequences[0]
    truncated = _provenance_datum(PROMPT, seq, 1.0)
    for loss in ("stable_reinforce", "importance_sampling"):
        fwd = tc.forward([truncated], loss).result()
        np.testing.assert_allclose(logprobs_of(fwd)[len(PROMPT) - 1 :], seq.logprobs, atol=2e-3)
    plain = logprobs_of(tc.forward([datum(PROMPT + seq.tokens)], "cross_entropy").result())
    assert np.abs(plain[len(PROMPT) - 1 :] - np.asarray(seq.logprobs)).mean() > 0.05  # untruncated
    with pytest.raises(Exception, match="were sampled with"):
        tc.forward([truncated], "ppo", loss_fn_config={"top_p": 0.9}).result()


def test_ephemeral_samplers_stay_usable_while_their_session_lives(trained) -> None:
    """DPO's reference sampler outlives many newer ephemeral samplers (it used to be evicted at the 5th)."""
    _, tc = trained
    params = types.SamplingParams(max_tokens=4, stop=[], temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    reference = tc.save_weights_and_get_sampling_client().result()
    first = reference.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
    for _ in range(6):
        tc.forward_backward(sft_dataset(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
    again = reference.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
    assert again == first


def test_a_repeated_prompt_reports_prefix_cache_hits(trained) -> None:
    """`SampleResponse.prompt_cache_hit_tokens` is vLLM's count: the second request for a prompt
    reads its whole blocks (128 tokens on CPU) from the prefix cache; never more than the prompt."""
    service, _ = trained
    sampler = service.create_sampling_client(base_model="tiny-qwen2").result()
    prompt = types.ModelInput.from_ints([3 + (7 * i) % 500 for i in range(150)])
    params = types.SamplingParams(max_tokens=2, stop=[], temperature=1.0, seed=5)
    sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(again.sequences) == 2
    assert 0 < again.prompt_cache_hit_tokens <= prompt.length  # the prompt's, not doubled per sample
