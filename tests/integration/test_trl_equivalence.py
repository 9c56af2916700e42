"""skylift's GRPO policy gradient equals TRL's `GRPOTrainer` on the same completions.

Same model (tiny-qwen2), same prompts and completions, same rewards: skylift's advantages
(`grpo`, std-normalised) and its policy loss (PPO clip, token mean) give the gradient TRL 1.16
computes with `loss_type="dapo"` (token mean over the batch), up to the advantage epsilon
(TRL divides by std + 1e-4, skylift by std + 1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skylift.algorithms import compute_advantages, mini_batch_totals, sequence_rewards_to_token_level
from skylift.config.schema import OptimizerConfig
from skylift.rl.objective import PolicyObjective
from skylift.worker.batch import build_sequence_batch
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

trl = pytest.importorskip("trl")

GROUP = 4


def test_policy_gradient_matches_trl(tiny_model_dir: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    gen = torch.Generator().manual_seed(0)
    chats = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(12, 34), (56, 7)]]
    prompts, responses, rewards = [], [], []
    for chat in chats:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        for g in range(GROUP):
            n = int(torch.randint(3, 12, (1,), generator=gen))
            prompts.append(list(ids))
            responses.append(torch.randint(10, 400, (n,), generator=gen).tolist() + [tok.eos_token_id])
            rewards.append(float(g != 1))  # 1, 0, 1, 1 in each group
    reward_t = torch.tensor(rewards)

    # skylift: advantages from the grpo estimator, gradient from the training worker
    worker = TrainingWorker(
        WorkerSettings(
            model_path=str(tiny_model_dir), optimizer=OptimizerSettings(OptimizerConfig(weight_decay=0.0))
        )
    )
    worker.setup()
    batch = build_sequence_batch(prompts, responses, pad_token_id=pad)
    token_rewards = sequence_rewards_to_token_level(reward_t, batch.response_mask)
    group_ids = [i // GROUP for i in range(len(prompts))]
    advantages, _ = compute_advantages("grpo", token_rewards, batch.response_mask, group_ids=group_ids)
    batch = batch.with_extras(advantages=advantages)
    totals = mini_batch_totals(batch.response_mask)
    objective = PolicyObjective(token_count=totals.token_count, seq_count=totals.seq_count)
    worker.accumulate_gradients(batch, objective, micro_batch_size=3)
    ours = {n: p.grad.detach().clone() for n, p in worker.model.named_parameters()}

    # TRL: its own advantage formula and _compute_loss on the same padded tensors
    grouped = reward_t.view(-1, GROUP)
    trl_adv = (reward_t - grouped.mean(1).repeat_interleave(GROUP)) / (
        grouped.std(1).repeat_interleave(GROUP) + 1e-4
    )
    assert torch.allclose(advantages[:, 0], trl_adv, atol=1e-3)
    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(prompts),
        num_generations=GROUP,
        max_completion_length=16,
        use_cpu=True,
        report_to=[],
        model_init_kwargs={"dtype": torch.float32},
        loss_type="dapo",
        beta=0.0,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": c} for c in chats] * GROUP),
        processing_class=tok,
    )
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    width_p, width_c = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((len(prompts), width_p), pad)
    prompt_mask = torch.zeros(len(prompts), width_p, dtype=torch.long)
    completion_ids = torch.full((len(prompts), width_c), pad)
    completion_mask = torch.zeros(len(prompts), width_c, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, width_p - len(p) :], prompt_mask[i, width_p - len(p) :] = torch.tensor(p), 1
        completion_ids[i, : len(r)], completion_mask[i, : len(r)] = torch.tensor(r), 1
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": trl_adv,
        "num_items_in_batch": completion_mask.sum().float(),
        "old_per_token_logps": None,
    }
    model.zero_grad()
    trainer._compute_loss(model, inputs).backward()  # noqa: SLF001 - the loss of one training step
    theirs = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    assert set(theirs) == set(ours)
    a = torch.cat([ours[n].flatten() for n in sorted(ours)])
    b = torch.cat([theirs[n].flatten() for n in sorted(ours)])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9999
    assert abs(a.norm() / b.norm() - 1) < 5e-3  # the advantage epsilons differ slightly
