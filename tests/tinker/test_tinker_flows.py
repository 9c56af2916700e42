"""The SDK's main flows against a real server: LoRA and full fine-tuning, sampling, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types
from tinker_helpers import datum, logprobs_of, sft_dataset

pytestmark = pytest.mark.integration


def _flow(service_client, tinker_server, rank: int) -> None:
    tc = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=rank).result()
    info = tc.get_info()
    assert info.is_lora is (rank > 0) and info.model_data.model_name == "tiny-qwen2"
    data = sft_dataset()
    fb = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    out = fb.result()
    assert step.result().metrics["grad_norm"] > 0
    assert set(out.metrics) >= {"loss:sum"} and all(":" in k for k in out.metrics)
    assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [23] * 4

    sampler_path = tc.save_weights_for_sampler("sampler-1").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/sampler-1"
    sampler = service_client.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:6])
    result = sampler.sample(
        prompt, num_samples=4, sampling_params=types.SamplingParams(max_tokens=8, seed=3)
    ).result()
    assert len(result.sequences) == 4
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 8 and seq.stop_reason in ("stop", "length")
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)

    # Sampling-support replay: tokens sampled with top-p/top-k, scored under the same parameters
    # (loss_fn_config), get the engine's logprobs; the plain softmax does not.
    truncated = types.SamplingParams(max_tokens=8, seed=5, temperature=0.9, top_p=0.7, top_k=20)
    seq = sampler.sample(prompt, num_samples=1, sampling_params=truncated).result().sequences[0]
    p, sampled = prompt.to_ints(), list(seq.tokens)
    zeros = [0.0] * (len(p) - 1)
    rl = datum(
        p + sampled,
        logprobs=np.asarray(zeros + list(seq.logprobs), dtype=np.float32),
        advantages=np.asarray(zeros + [1.0] * len(sampled), dtype=np.float32),
    )
    config = {"temperature": 0.9, "top_p": 0.7, "top_k": 20}
    replayed = logprobs_of(tc.forward([rl], "importance_sampling", config).result())[len(zeros) :]
    gap = np.abs(replayed - np.asarray(seq.logprobs))
    plain = logprobs_of(tc.forward([rl], "importance_sampling").result())[len(zeros) :]
    before = np.abs(plain - np.asarray(seq.logprobs))
    print(
        f"\ntinker, top_p=0.7 top_k=20: |engine - trainer| mean {before.mean():.3g} before, {gap.mean():.1e} (max {gap.max():.1e}) after"
    )
    assert gap.max() <= 1e-3, gap  # the tolerance of the teacher-forced check below (fp32, merged LoRA)
    assert before.mean() > 0.05

    # The engine's teacher-forced logprobs equal the trainer's (same weights, fp32).
    full = data[0].model_input.to_ints() + [int(data[0].loss_fn_inputs["target_tokens"].data[-1])]
    engine_lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert engine_lp[0] is None and len(engine_lp) == len(full)
    trainer_lp = logprobs_of(tc.forward([data[0]], "cross_entropy").result())
    np.testing.assert_allclose(np.asarray(engine_lp[1:], dtype=float), trainer_lp, atol=1e-3)

    state_path = tc.save_state("state-1").result().path
    assert state_path == f"tinker://{tc.model_id}/weights/state-1"
    tc2 = service_client.create_training_client_from_state_with_optimizer(state_path).result()
    assert tc2.model_id != tc.model_id
    resumed = logprobs_of(tc2.forward([data[0]], "cross_entropy").result())
    np.testing.assert_allclose(resumed, trainer_lp, atol=1e-5)
    tc2.forward_backward(data, "cross_entropy").result()
    tc2.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    rest = tinker.RestClient(base_url=tinker_server.url, api_key="tml-dummy")
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {sampler_path, state_path}
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [state_path]
    run = rest.get_training_run(tc.model_id).result()
    assert run.is_lora is (rank > 0) and run.last_checkpoint.tinker_path == state_path


def test_lora_flow(service_client, tinker_server) -> None:
    _flow(service_client, tinker_server, rank=8)


def test_full_finetune_flow(service_client, tinker_server) -> None:
    """rank=0 in lora_config means full fine-tuning on this server."""
    _flow(service_client, tinker_server, rank=0)


def test_ephemeral_sampler_and_stop_rules(service_client) -> None:
    tc = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()
    tc.forward_backward(sft_dataset(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 8, 11, 14])
    never_stop = types.SamplingParams(max_tokens=12, stop=[], temperature=1.0, seed=0)
    res = sampler.sample(prompt, num_samples=2, sampling_params=never_stop).result()
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for s in res.sequences)
    # Same seed, same weights: same samples.
    again = sampler.sample(prompt, num_samples=2, sampling_params=never_stop).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
    stop_tok = res.sequences[0].tokens[3]
    stopped = sampler.sample(
        prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=12, stop=[stop_tok], seed=0)
    ).result()
    assert stopped.sequences[0].stop_reason == "stop"
    base = service_client.create_sampling_client(base_model="tiny-qwen2").result()
    base_res = base.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4)).result()
    assert len(base_res.sequences[0].tokens) >= 1


def test_sft_loss_halves_in_20_steps(service_client) -> None:
    tc = service_client.create_lora_training_client(base_model="tiny-qwen2", rank=16).result()
    data = sft_dataset()
    losses = []
    for _ in range(20):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics["loss:sum"])
    final = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert final < 0.5 * losses[0], (losses, final)
