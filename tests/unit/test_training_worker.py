"""The FSDP2 training worker on the tiny model: logprobs, micro-batch equivalence, checkpoints, export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tolerances import assert_gradients_close, assert_sums_close, sum_tolerance

from skylift.algorithms import mini_batch_totals
from skylift.config.algorithm import AlgorithmConfig
from skylift.config.schema import OptimizerConfig
from skylift.models.tiny_qwen2 import INTERMEDIATE_SIZE, VOCAB_SIZE
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import SequenceBatch, build_sequence_batch
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def _batch(vocab: int, rows: int = 8, seed: int = 0) -> SequenceBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(5, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(rows)
    ]
    responses = [
        torch.randint(5, vocab, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(rows)
    ]
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    advantages = torch.randn(rows, 1, generator=gen).expand(-1, batch.response_len) * batch.response_mask
    return batch.with_extras(advantages=advantages.contiguous())


@pytest.fixture()
def worker(tiny_model_dir: Path, tmp_path: Path):
    settings = WorkerSettings(
        model_path=str(tiny_model_dir),
        fsdp=True,
        optimizer=OptimizerSettings(OptimizerConfig(lr=1e-2, weight_decay=0.0)),
    )
    w = TrainingWorker(settings, init_method=f"file://{tmp_path / 'rdzv'}")
    w.setup()
    yield w
    w.shutdown()


def _reference_logprobs(model_dir: Path, batch: SequenceBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = torch.zeros(batch.batch_size, batch.response_len)
    for i in range(batch.batch_size):  # one unpadded row at a time
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        n_resp = int(batch.response_mask[i].sum())
        logits = model(ids.unsqueeze(0)).logits[0].log_softmax(-1)
        start = len(ids) - n_resp
        for t in range(n_resp):
            out[i, t] = logits[start + t - 1, ids[start + t]]
    return out


def test_logprobs_match_unpadded_transformers(worker: TrainingWorker, tiny_model_dir: Path) -> None:
    batch = _batch(vocab=500)
    got = worker.compute_logprobs(batch, micro_batch_size=3)
    want = _reference_logprobs(tiny_model_dir, batch)
    # padded micro-batches of 3 vs one unpadded row: each log-softmax sums VOCAB_SIZE terms
    assert_sums_close(got, want, VOCAB_SIZE)


def test_micro_batches_give_the_same_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch = _batch(vocab=500, seed=1)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    params = []
    tokens = int(batch.attention_mask.sum())  # a weight's gradient sums one term per token
    for i, micro in enumerate((8, 2)):
        # eps=1 makes the Adam step ~ lr * grad, so updated weights compare gradients (a plain Adam
        # step is ~ lr * sign(grad): round-off on near-zero gradients would flip it)
        settings = WorkerSettings(
            model_path=str(tiny_model_dir),
            optimizer=OptimizerSettings(OptimizerConfig(lr=1.0, weight_decay=0.0), eps=1.0),
        )
        w = TrainingWorker(settings, init_method=f"file://{tmp_path / f'rdzv{i}'}")
        w.setup()
        if i == 0:
            start = {k: v.detach().clone() for k, v in w.iter_full_weights()}
        metrics = w.train_mini_batch(batch, objective, micro_batch_size=micro)
        assert metrics["grad_norm"] > 0
        params.append({k: v.detach().clone() for k, v in w.iter_full_weights()})
        w.shutdown()
    # the updates ~ lr * grad sum one term per token, at their module's scale (as in
    # `assert_gradients_close`); writing weight - update rounds by half an ulp of the weight per run
    scale: dict[str, float] = {}
    for name, weight in start.items():
        module = name.rsplit(".", 1)[0]
        scale[module] = max(scale.get(module, 0.0), float((params[0][name] - weight).abs().max()))
    for name, weight in start.items():
        tol = sum_tolerance(scale[name.rsplit(".", 1)[0]], tokens)
        tol += torch.finfo(weight.dtype).eps * float(weight.abs().max())
        worst = float((params[0][name] - params[1][name]).abs().max())
        assert worst <= tol, (name, worst, tol)


def test_a_clip_norm_of_zero_disables_clipping(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``max_grad_norm`` <= 0 (the config's way to turn clipping off) steps as an unreachable norm
    does, and a small norm changes the step (eps=1: the Adam step ~ lr * grad sees the clip)."""
    batch = _batch(vocab=500, seed=4)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    weights = {}
    for i, norm in enumerate((0.0, 1e9, 1e-3)):
        config = OptimizerConfig(lr=1.0, weight_decay=0.0, max_grad_norm=norm)
        settings = WorkerSettings(
            model_path=str(tiny_model_dir), optimizer=OptimizerSettings(config, eps=1.0)
        )
        w = TrainingWorker(settings, init_method=f"file://{tmp_path / f'rdzv{i}'}")
        w.setup()
        w.train_mini_batch(batch, objective, micro_batch_size=8)
        weights[norm] = {k: v.detach().clone() for k, v in w.iter_full_weights()}
        w.shutdown()
    assert all(torch.equal(weights[0.0][k], weights[1e9][k]) for k in weights[0.0])
    assert any(not torch.equal(weights[0.0][k], weights[1e-3][k]) for k in weights[0.0])


def test_training_step_changes_weights_and_checkpoint_round_trips(
    worker: TrainingWorker, tmp_path: Path
) -> None:
    batch = _batch(vocab=500, seed=2)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    before = {k: v.clone() for k, v in worker.iter_full_weights()}
    worker.train_mini_batch(batch, objective, micro_batch_size=4)
    after = {k: v.clone() for k, v in worker.iter_full_weights()}
    assert any(not torch.equal(before[k], after[k]) for k in before)

    worker.save_checkpoint(str(tmp_path / "ckpt"))
    worker.train_mini_batch(batch, objective, micro_batch_size=4)  # move away, then come back
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    restored = dict(worker.iter_full_weights())
    for k in after:
        assert torch.equal(after[k], restored[k]), k
    assert worker.global_step == 1


def test_export_loads_in_transformers(worker: TrainingWorker, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = worker.export_hf(str(tmp_path / "export"))
    assert out is not None
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    weights = dict(worker.iter_full_weights())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_batch_select_trims_padding() -> None:
    batch = build_sequence_batch([[1, 2, 3], [4]], [[5], [6, 7, 8]], pad_token_id=0)
    sub = batch.select([1])
    assert sub.input_ids.tolist() == [[4, 6, 7, 8]]
    assert sub.prompt_len == 1
    assert sub.response_mask.tolist() == [[1.0, 1.0, 1.0]]


def test_batch_rejects_mismatched_masks() -> None:
    with pytest.raises(ValueError, match="loss mask has 1 entries for 2 tokens"):
        build_sequence_batch([[1]], [[2, 3]], loss_masks=[[1]])


def test_shared_prompt_forward_equals_full_forward(tiny_model_dir: Path) -> None:
    """Rows sharing a prompt reuse one prompt pass: same logprobs and same gradients."""
    from transformers import AutoModelForCausalLM

    from skylift.worker.logprobs import response_logprobs, unique_prompts

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(3):
        prompt = torch.randint(
            5, 500, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(4):
            prompts.append(prompt)
            n = int(torch.randint(1, 9, (1,), generator=gen))
            responses.append(torch.randint(5, 500, (n,), generator=gen).tolist())
    batch = build_sequence_batch(prompts, responses)
    first, inverse = unique_prompts(batch)
    assert (
        len(first) == 3 and inverse.tolist() == [0] * 4 + [1] * 4 + [2] * 4 or len(set(inverse.tolist())) == 3
    )

    results = []
    for share in (False, True):
        model.zero_grad()
        logp = response_logprobs(model, batch, temperature=0.7, share_prompts=share)
        (logp * batch.response_mask).sum().backward()
        results.append(
            (logp.detach() * batch.response_mask, {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    (full, full_grads), (shared, shared_grads) = results
    assert_sums_close(shared, full, VOCAB_SIZE)  # each log-softmax sums VOCAB_SIZE terms
    tokens = int(batch.attention_mask.sum())  # a weight's gradient sums one term per token
    assert_gradients_close(shared_grads, full_grads, tokens)


@pytest.mark.parametrize(
    ("name", "warmup", "expected"),
    [
        ("constant", 0, [1.0, 1.0, 1.0, 1.0]),
        ("constant_with_warmup", 2, [0.0, 0.5, 1.0, 1.0]),
        ("linear", 0, [1.0, 0.75, 0.5, 0.25]),
        ("linear", 1, [0.0, 1.0, 2 / 3, 1 / 3]),
        ("cosine", 0, [1.0, 0.8535534, 0.5, 0.1464466]),
    ],
)
def test_lr_schedules_by_hand(name: str, warmup: int, expected: list[float]) -> None:
    from skylift.worker.training_worker import OptimizerSettings, make_lr_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_lr_scheduler(
        opt,
        OptimizerSettings(OptimizerConfig(lr=1.0, scheduler=name, num_warmup_steps=warmup), total_steps=4),
    )
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(expected, abs=1e-6)


def test_lr_schedule_errors_are_clear() -> None:
    from skylift.worker.training_worker import OptimizerSettings, make_lr_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="decays over total_steps"):
        make_lr_scheduler(opt, OptimizerSettings(OptimizerConfig(scheduler="linear")))
    with pytest.raises(ValueError, match="unknown scheduler 'step'"):
        make_lr_scheduler(opt, OptimizerSettings(OptimizerConfig(scheduler="step")))


def test_value_head_worker_reads_values_where_logits_would_predict(tiny_model_dir: Path) -> None:
    """A critic (head="value") scores V(state before each response token) and learns toward targets."""
    from transformers import AutoModelForTokenClassification

    from skylift.rl.objective import ValueObjective

    critic = TrainingWorker(
        WorkerSettings(
            model_path=str(tiny_model_dir),
            head="value",
            optimizer=OptimizerSettings(OptimizerConfig(lr=1e-3, weight_decay=0.0)),
        )
    )
    critic.setup()
    batch = _batch(vocab=500, rows=4)
    values = critic.compute_values(batch, micro_batch_size=2)
    assert values.shape == (4, batch.response_len)
    state = {k: v.clone() for k, v in critic.model.state_dict().items()}
    plain = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    plain.load_state_dict(state)
    plain.eval()
    for row in range(4):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()]
        n_prompt = int(batch.attention_mask[row, : batch.prompt_len].sum())
        n_resp = int(batch.response_mask[row].sum())
        with torch.no_grad():
            scores = plain(ids[None]).logits[0, :, 0]
        expected = scores[n_prompt - 1 : n_prompt - 1 + n_resp]
        # padded micro-batch vs one unpadded row; the longest sum behind a value is the MLP's
        assert_sums_close(values[row, :n_resp], expected, INTERMEDIATE_SIZE)

    targets = torch.full_like(values, 1.0) * batch.response_mask
    fitted = batch.with_extras(values=values, returns=targets)
    objective = ValueObjective(value_clip=0.0, token_count=float(batch.response_mask.sum()))
    losses = [critic.train_mini_batch(fitted, objective, 2)["value_loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0]


def test_critic_lora_trains_only_the_adapters_and_the_value_head(tiny_model_dir: Path) -> None:
    """SkyRL's `trainer.critic.model.lora.*`: the backbone's weights stay as loaded, the adapters
    and the (new) value head move, and the critic still learns its targets."""
    from skylift.cluster.settings import critic_worker_settings
    from skylift.config import load_config
    from skylift.rl.objective import ValueObjective

    cfg = load_config(
        [
            f"trainer.critic.model.path={tiny_model_dir}",
            "trainer.critic.model.lora.rank=4",
            "trainer.critic.model.lora.alpha=8",
            "trainer.critic.model.lora.target_modules=[q_proj,v_proj]",
            "trainer.critic.optimizer_config.lr=1e-2",
            "trainer.algorithm.advantage_estimator=gae",
        ]
    )
    settings = critic_worker_settings(cfg, total_steps=5)
    assert (settings.lora_rank, settings.lora_alpha, settings.lora_target_modules) == (
        4,
        8,
        ["q_proj", "v_proj"],
    )
    critic = TrainingWorker(settings)
    critic.setup()
    model = critic.model
    assert model is not None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(
        ("lora_" in n and ("q_proj" in n or "v_proj" in n)) or ".score." in n for n in trainable
    )
    assert {n for n in trainable if ".score." in n} == {
        "base_model.model.score.weight",
        "base_model.model.score.bias",
    }
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _batch(vocab=500, rows=4)
    values = critic.compute_values(batch, micro_batch_size=2)
    targets = torch.full_like(values, 1.0) * batch.response_mask
    fitted = batch.with_extras(values=values, returns=targets)
    objective = ValueObjective(value_clip=0.0, token_count=float(batch.response_mask.sum()))
    losses = [critic.train_mini_batch(fitted, objective, 2)["value_loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0]
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved == trainable  # every adapter and the head moved (lora_B starts at 0), nothing else


@pytest.mark.parametrize("loss_type", ["regular", "dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_skipping_zero_advantage_rows_gives_the_same_gradient(
    tiny_model_dir: Path, loss_type: str, reduction: str
) -> None:
    """Rows whose advantages are all zero add nothing: training without them (normalised by the
    whole mini-batch's counts) gives the gradient of the whole mini-batch."""
    from skylift.rl.objective import rows_with_policy_gradient

    batch = _batch(vocab=500, seed=3)
    advantages = batch.extras["advantages"].clone()
    advantages[[1, 2, 5]] = 0.0  # three rows without signal (e.g. a group with equal rewards)
    batch = batch.with_extras(advantages=advantages, old_logprobs=batch.extras["advantages"] * 0.01 - 1.0)
    totals = mini_batch_totals(batch.response_mask)
    objective = PolicyObjective(
        AlgorithmConfig(policy_loss_type=loss_type, loss_reduction=reduction),
        token_count=totals.token_count,
        seq_count=totals.seq_count,
        max_len=batch.response_len,
    )
    keep = rows_with_policy_gradient(batch.extras["advantages"], batch.response_mask)
    assert keep == [0, 3, 4, 6, 7]
    grads = []
    for rows in (list(range(batch.batch_size)), keep):
        w = TrainingWorker(WorkerSettings(model_path=str(tiny_model_dir)))
        w.setup()
        w.accumulate_gradients(batch.select(rows), objective, micro_batch_size=3)
        grads.append({n: p.grad.clone() for n, p in w.model.named_parameters()})
    tokens = int(batch.attention_mask.sum())  # a weight's gradient sums one term per token
    assert_gradients_close(grads[1], grads[0], tokens)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_rows_with_policy_gradient_keeps_enough_rows() -> None:
    from skylift.rl.objective import rows_with_policy_gradient

    adv = torch.zeros(4, 3)
    mask = torch.ones(4, 3)
    assert rows_with_policy_gradient(adv, mask, min_rows=2) == [0, 1]
    adv[3, 1] = 0.5
    assert rows_with_policy_gradient(adv, mask) == [3]
    assert rows_with_policy_gradient(adv, mask, min_rows=2) == [0, 3]
    mask[3, 1] = 0.0  # an advantage under the mask does not count
    assert rows_with_policy_gradient(adv, mask) == [0]


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`compute_dtype="bfloat16"` (trainer.bf16): bf16 matmuls, float32 weights and optimizer
    state, so an update far below bf16's resolution still moves the weights."""
    batch = _batch(vocab=500, seed=3)
    want = _reference_logprobs(tiny_model_dir, batch)
    settings = WorkerSettings(
        model_path=str(tiny_model_dir),
        compute_dtype="bfloat16",
        optimizer=OptimizerSettings(OptimizerConfig(lr=1e-7, weight_decay=0.0)),
    )
    w = TrainingWorker(settings, init_method=f"file://{tmp_path / 'rdzv'}")
    w.setup()
    try:
        got = w.compute_logprobs(batch, micro_batch_size=4)
        diff = (got - want.detach()).abs()[batch.response_mask.bool()]
        assert 1e-4 < float(diff.mean()) < 5e-2  # bf16 round-off: computed in bf16, yet close
        assert got.dtype == torch.float32

        totals = mini_batch_totals(batch.response_mask)
        objective = dataclasses.replace(
            PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
        )
        before = {k: v.clone() for k, v in w.iter_full_weights()}
        w.train_mini_batch(batch, objective, micro_batch_size=4)
        after = dict(w.iter_full_weights())
        assert all(t.dtype == torch.float32 for t in after.values())
        name = "model.layers.0.mlp.down_proj.weight"
        moved = after[name] != before[name]
        assert moved.float().mean() > 0.5  # Adam moves almost every weight by ~lr = 1e-7 ...
        # ... which bf16 weights would have rounded away
        assert (after[name].bfloat16() != before[name].bfloat16()).float().mean() < 0.01
    finally:
        w.shutdown()
