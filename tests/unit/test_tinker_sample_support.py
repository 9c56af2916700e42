"""Sampling-support replay in the Tinker service's RL losses (skylift.tinker.training.loss_sampling).

A LoRA `TrainedModel` (tiny model, fp32; no server) gets data sampled the way the engine samples
(vLLM's processed distribution, transcribed in vllm_sampler_reference.py) and the sampling
parameters in ``loss_fn_config``: its logprobs of the sampled tokens equal the sampler's, and the
`importance_sampling` and `ppo` losses give no gradient to logits outside the support. Without the
keys the trainer scores the plain softmax, as the Tinker API does, and both checks fail. Recorded
sequences (record_stability_info) carry their distribution, which the server fills in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb
from vllm_sampler_reference import reference_logprobs

from skylift.algorithms.sample_support import TokenDistribution, support_mask
from skylift.tinker.core.errors import UserError
from skylift.tinker.core.provenance import Span, StabilityRecords
from skylift.tinker.core.wire import ForwardBackwardCall, WireDatum
from skylift.tinker.training.loss_sampling import loss_distribution, recorded_config, sampled_distribution
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel

PROMPTS = [[5, 17, 230, 999, 42, 8], [900, 3, 3, 64], [77, 12, 5]]
CONFIGS = {
    "top_p=0.7": {"top_p": 0.7},
    "top_k=20": {"top_k": 20.0},  # loss_fn_config values arrive as floats
    "T=0.5,min_p=0.3": {"temperature": 0.5, "min_p": 0.3},
    "T=0.9,top_k=20,top_p=0.7,min_p=0.05": {"temperature": 0.9, "top_k": 20, "top_p": 0.7, "min_p": 0.05},
}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> TrainedModel:
    m = TrainedModel("t", ModelConfig(base_model="tiny", model_path=str(tiny_model_dir), lora_rank=4), 2)
    m.setup()
    assert m.worker is not None
    with torch.no_grad():  # the adapter starts at zero: move it, so that LoRA changes the logits
        for name, p in m.worker.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
    return m


def _sample(model: TrainedModel, prompt: list[int], dist: TokenDistribution, n: int, seed: int):
    """`n` tokens drawn as the engine draws them, with the logprobs it reports."""
    assert model.worker is not None
    net, gen = model.worker.model, torch.Generator().manual_seed(seed)
    ids, tokens, logprobs = list(prompt), [], []
    was_training = net.training
    net.eval()
    for _ in range(n):
        with torch.no_grad():
            logits = net(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        processed = reference_logprobs(logits, dist)
        token = int(torch.multinomial(processed.exp(), 1, generator=gen))
        tokens.append(token)
        logprobs.append(float(processed[token]))
        ids.append(token)
    net.train(was_training)
    return tokens, logprobs


_SAMPLED: dict[TokenDistribution, tuple[list[WireDatum], list[np.ndarray]]] = {}


def _data(model: TrainedModel, dist: TokenDistribution) -> tuple[list[WireDatum], list[np.ndarray]]:
    """One datum per prompt (prompt + sampled tokens, advantages on the sampled ones), and the
    sampler's logprobs of those tokens (sampled once per distribution; the model never steps)."""
    if dist not in _SAMPLED:
        _SAMPLED[dist] = _sample_data(model, dist)
    return _SAMPLED[dist]


def _sample_data(model: TrainedModel, dist: TokenDistribution) -> tuple[list[WireDatum], list[np.ndarray]]:
    data, sampled = [], []
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = _sample(model, prompt, dist, n=6 + 2 * i, seed=i)
        p = len(prompt) - 1
        inputs = {
            "target_tokens": np.array(prompt[1:] + tokens, dtype=np.int64),
            "logprobs": np.array([0.0] * p + logprobs, dtype=np.float32),
            "advantages": np.array([0.0] * p + [1.0 - i] * len(tokens), dtype=np.float32),
        }
        data.append(WireDatum(tokens=prompt + tokens[:-1], inputs=inputs))
        sampled.append(np.array(logprobs, dtype=np.float32))
    return data, sampled


def _call(data: list[WireDatum], loss: str, config: dict, forward_only: bool) -> ForwardBackwardCall:
    return ForwardBackwardCall(
        model_id="t", seq_id=1, loss_fn=loss, forward_only=forward_only, data=data, loss_fn_config=config
    )


def _logprobs(model: TrainedModel, call: ForwardBackwardCall) -> list[np.ndarray]:
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(model.forward_backward(call))
    field = msg.loss_fn_outputs[0].fields["logprobs"]
    offsets = np.frombuffer(field.offsets, dtype=np.int64)
    data = np.frombuffer(field.data, dtype=np.float32)
    return [data[offsets[i] // 4 : offsets[i + 1] // 4] for i in range(len(offsets) - 1)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trainer_logprobs_equal_the_samplers(model: TrainedModel, name: str) -> None:
    config = CONFIGS[name]
    data, sampled = _data(model, loss_distribution(config))
    for loss in ("importance_sampling", "ppo"):
        rows = _logprobs(model, _call(data, loss, config, forward_only=True))
        gaps = [np.abs(row[len(p) - 1 :] - want) for row, p, want in zip(rows, PROMPTS, sampled, strict=True)]
        assert max(float(g.max()) for g in gaps) <= 1e-5, (name, loss, gaps)
        assert all(np.isfinite(row).all() for row in rows)  # prompt tokens outside the support join it
    plain = _logprobs(model, _call(data, "importance_sampling", {}, forward_only=True))
    before = np.concatenate(
        [row[len(p) - 1 :] - want for row, p, want in zip(plain, PROMPTS, sampled, strict=True)]
    )
    assert float(np.abs(before).mean()) > 0.05, (name, before)  # the untruncated scoring is biased


def _logit_grads(model: TrainedModel, call: ForwardBackwardCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the (one) micro-batch's forward pass and their gradient."""
    assert model.worker is not None
    outputs: list[torch.Tensor] = []

    def keep(_module, _inputs, output):
        output.retain_grad()
        outputs.append(output)

    handle = model.worker.model.get_output_embeddings().register_forward_hook(keep)
    try:
        model.worker.zero_grad()
        model.forward_backward(call)
    finally:
        handle.remove()
        model.worker.zero_grad()
    [logits] = outputs
    assert logits.grad is not None
    return logits.detach(), logits.grad


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo"])
def test_no_gradient_outside_the_sampling_support(model: TrainedModel, loss: str) -> None:
    config = CONFIGS["T=0.9,top_k=20,top_p=0.7,min_p=0.05"]
    dist = loss_distribution(config)
    data, _ = _data(model, dist)
    micro = model.micro_batch_size
    model.micro_batch_size = len(data)  # one forward pass: one set of logits to inspect
    try:
        logits, grad = _logit_grads(model, _call(data, loss, config, forward_only=False))
        _, plain_grad = _logit_grads(model, _call(data, loss, {}, forward_only=False))
    finally:
        model.micro_batch_size = micro
    flat = logits.reshape(-1, logits.shape[-1])
    keep = support_mask(flat / dist.temperature, dist)
    scored = grad.reshape(flat.shape).abs().sum(-1) > 0  # the sampled positions (advantage != 0)
    n_sampled = sum(6 + 2 * i for i in range(len(PROMPTS)) if i != 1)  # prompt 1 has advantage 0
    assert int(scored.sum()) == n_sampled
    assert int((~keep[scored]).sum(-1).min()) > 900  # most of the 1024 tokens are cut
    assert (grad.reshape(flat.shape)[scored][~keep[scored]] == 0).all()
    assert (grad.reshape(flat.shape)[scored][keep[scored]] != 0).any()
    # without the keys the gradient leaks: at every position it reaches (ppo clips some), it reaches
    # the tokens outside the support too
    plain = plain_grad.reshape(flat.shape)
    reached = plain.abs().sum(-1) > 0
    assert int(reached.sum()) >= 6
    assert (plain[reached][~keep[reached]] != 0).float().mean() > 0.9


def test_sampling_keys_are_checked_and_named_in_the_error() -> None:
    assert loss_distribution({}) == TokenDistribution()
    assert loss_distribution({"temperature": 0.0, "top_p": 0.5}) == TokenDistribution()  # greedy
    assert loss_distribution({"top_k": 0.0, "temperature": 0.7}) == TokenDistribution(0.7)
    bad = [
        ({"top_p": 0.0}, r"top_p'\] must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p'\] must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p'\] must be in \[0, 1\]"),
        ({"top_k": 2.5}, r"top_k'\] must be an integer >= -1"),
        ({"top_k": -2.0}, r"top_k'\] must be an integer >= -1"),
        ({"temperature": -1.0}, r"temperature'\] must be >= 0"),
        ({"temperature": float("nan")}, r"temperature'\] must be finite"),
        ({"top_p": "high"}, r"top_p'\] must be a number"),
    ]
    for config, message in bad:
        with pytest.raises(UserError, match=message):
            loss_distribution(config)


def test_cross_entropy_refuses_sampling_keys(model: TrainedModel) -> None:
    datum = WireDatum(tokens=[5, 6, 7], inputs={"target_tokens": np.array([6, 7, 8])})
    with pytest.raises(UserError, match="do not apply to loss 'cross_entropy'"):
        model.forward_backward(_call([datum], "cross_entropy", {"top_p": 0.7}, forward_only=True))
    rl = {name: np.zeros(3, dtype=np.float32) for name in ("logprobs", "advantages")}
    data = [WireDatum(tokens=[5, 6, 7], inputs={"target_tokens": np.array([6, 7, 8]), **rl})]
    with pytest.raises(UserError, match=r"top_p'\] must be in \(0, 1\]"):
        model.forward_backward(_call(data, "ppo", {"top_p": 2.0}, forward_only=True))


def test_records_remember_the_distribution_each_sequence_was_sampled_with() -> None:
    cut = sampled_distribution(0.9, 20, 0.7)
    records = StabilityRecords()
    records.add("a:0", "s", [7, 8], [-0.1, -0.2], cut)
    records.add("a:1", "s", [9], [-0.3], cut)
    records.add("b:0", "s", [4], [-0.4])  # untruncated
    both = [[Span(False, "a:0", 0, 2), Span(True, "a:0", 0, 2)], [Span(True, "a:1", 0, 1)]]
    assert records.sampling_of(both, "s") == {cut}
    assert records.sampling_of([*both, [Span(True, "b:0", 0, 1)]], "s") == {cut, TokenDistribution()}
    assert records.sampling_of([*both, [Span(True, "c:0", 0, 1)]], "s") is None  # no record
    assert records.sampling_of([*both, None], "s") is None  # a datum without provenance
    assert records.sampling_of(both, "other-session") is None
    # the server fills the keys in, and refuses keys or data that contradict the records
    assert loss_distribution(recorded_config({"clip_low_threshold": 0.5}, {cut})) == cut
    assert recorded_config({"top_k": 20, "top_p": 0.7, "temperature": 0.9}, {cut})["top_k"] == 20
    assert recorded_config({"beta": 0.1}, None) == {"beta": 0.1}
    with pytest.raises(UserError, match="were sampled with"):
        recorded_config({"top_p": 0.7}, {cut})
    with pytest.raises(UserError, match="different sampling parameters"):
        recorded_config({}, {cut, TokenDistribution()})
    assert sampled_distribution(0.0, 20, 0.5) == TokenDistribution()  # greedy: nothing cut
    assert sampled_distribution(0.7, 0, 1.0) == sampled_distribution(0.7, -1, 1.0)
