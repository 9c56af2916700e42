"""Item 4: one GRPO update (experience -> loss -> step) from rollouts saved on CPU.

The reference phase samples the rollouts on CPU with the tiny model (4 prompts x 4 samples, its own
sampling loop, so the rollout logprobs are those of the distribution sampled from) and saves them as
`rollouts.json`; both phases then build the experience from that file (batch, GRPO advantages from a
rule-based reward, old and reference logprobs from the workers), train one mini-batch with the
trainer's `PolicyObjective` (PPO-clip + k3 KL loss) and score the batch again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpucheck.device import Context
from gpucheck.report import TOLERANCES, Item, max_abs, scalar_rel
from skylift.algorithms import compute_advantages, mini_batch_totals, sequence_rewards_to_token_level
from skylift.trainer.objective import PolicyObjective
from skylift.training.batch import build_sequence_batch
from skylift.training.worker import OptimizerSettings, TrainingWorker, WorkerSettings

PROMPTS = ("What is 2 + 3?", "Name a colour.", "Count to three.", "Say hello to Ada.")
SAMPLES = 4
MAX_TOKENS = 12
SEED = 99


def sample_rollouts(model_dir: Path, out: Path) -> dict[str, Any]:
    """Sample on CPU (float32, temperature 1) and save prompts, responses, logprobs and rewards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = int(tok.eos_token_id)
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(SEED)
    rollouts: dict[str, list] = {
        "prompts": [],
        "responses": [],
        "rollout_logprobs": [],
        "rewards": [],
        "uids": [],
    }
    for uid, text in enumerate(PROMPTS):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompt = tok(chat, add_special_tokens=False)["input_ids"]
        for _ in range(SAMPLES):
            ids, logps = list(prompt), []
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits, -1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=g))
                    ids.append(token)
                    logps.append(float(logp[token]))
                    if token == eos:
                        break
            response = ids[len(prompt) :]
            rollouts["prompts"].append(prompt)
            rollouts["responses"].append(response)
            rollouts["rollout_logprobs"].append(logps)
            rollouts["rewards"].append(sum(t < vocab // 2 for t in response) / len(response))
            rollouts["uids"].append(f"prompt-{uid}")
    rollouts["pad_token_id"] = int(tok.pad_token_id)
    out.write_text(json.dumps(rollouts))
    return rollouts


class _Recording:
    """The trainer's objective, remembering the loss it returned for each micro-batch."""

    def __init__(self, objective: PolicyObjective) -> None:
        self.objective = objective
        self.losses: list[float] = []

    def __call__(self, logprobs, micro, entropy):  # type: ignore[no-untyped-def]
        loss, metrics = self.objective(logprobs, micro, entropy)
        self.losses.append(float(loss.detach()))
        return loss, metrics


def grpo_update(model_dir: Path, rollouts: dict[str, Any]) -> dict[str, Any]:
    batch = build_sequence_batch(
        rollouts["prompts"],
        rollouts["responses"],
        pad_token_id=rollouts["pad_token_id"],
        per_token={"rollout_logprobs": rollouts["rollout_logprobs"]},
    )
    rewards = torch.tensor(rollouts["rewards"], dtype=torch.float32)
    token_rewards = sequence_rewards_to_token_level(rewards, batch.response_mask)
    advantages, _ = compute_advantages("grpo", token_rewards, batch.response_mask, group_ids=rollouts["uids"])
    settings = WorkerSettings(
        model_path=str(model_dir), optimizer=OptimizerSettings(lr=1e-3, scheduler="constant"), seed=5
    )
    policy = TrainingWorker(settings)
    ref = TrainingWorker(WorkerSettings(model_path=str(model_dir), trainable=False))
    policy.setup()
    ref.setup()
    old = policy.compute_logprobs(batch, 8)
    ref_lp = ref.compute_logprobs(batch, 8)
    batch = batch.with_extras(old_logprobs=old, ref_logprobs=ref_lp, advantages=advantages)
    totals = mini_batch_totals(batch.response_mask)
    objective = _Recording(
        PolicyObjective(
            loss_type="regular",
            loss_reduction="token_mean",
            use_kl_loss=True,
            kl_loss_coef=0.01,
            token_count=totals.token_count,
            seq_count=totals.seq_count,
        )
    )
    metrics = policy.train_mini_batch(batch, objective, micro_batch_size=4)
    new = policy.compute_logprobs(batch, 8)
    mask = batch.response_mask
    out = {
        "advantages": advantages,
        "old": old,
        "ref": ref_lp,
        "new": new,
        "loss": sum(objective.losses),
        "micro_batches": len(objective.losses),
        "grad_norm": metrics["grad_norm"],
        "policy_loss": metrics["policy_loss"],
        "vs_rollout": float(((old - batch.extras["rollout_logprobs"]).abs() * mask).sum() / mask.sum()),
        "device": str(policy.device),
        "rows": batch.batch_size,
        "tokens": int(mask.sum()),
    }
    policy.shutdown()
    ref.shutdown()
    return out


def reference(ctx: Context) -> dict[str, Any]:
    rollouts = sample_rollouts(ctx.tiny_dir, ctx.work / "rollouts.json")
    return {"grpo": grpo_update(ctx.tiny_dir, rollouts)}


def item_grpo(ctx: Context, refs: dict[str, Any], item: Item) -> None:
    saved = ctx.work / "rollouts.json"
    rollouts = json.loads(saved.read_text())
    ref = refs["grpo"]
    got = grpo_update(ctx.tiny_dir, rollouts)
    lp = TOLERANCES["logprobs_abs"]
    item.figures["rollouts"] = f"{got['rows']} rows, {got['tokens']} response tokens, from {saved.name}"
    item.figures["device"] = got["device"]
    item.figures["loss (device / cpu)"] = f"{got['loss']:.6g} / {ref['loss']:.6g}"
    item.holds("same advantages (pure CPU step)", torch.equal(got["advantages"], ref["advantages"]))
    item.holds("advantages are not all zero", bool(got["advantages"].abs().sum() > 0))
    item.at_most("old logprobs, max |diff|", max_abs(got["old"], ref["old"]), lp)
    item.at_most("reference logprobs, max |diff|", max_abs(got["ref"], ref["ref"]), lp)
    item.at_most("trainer vs sampler logprobs of the rollouts, mean |diff|", got["vs_rollout"], lp)
    item.at_most("loss, rel diff", scalar_rel(got["loss"], ref["loss"]), TOLERANCES["loss_rel"])
    item.holds(
        "gradients accumulated over the same micro-batches",
        got["micro_batches"] == ref["micro_batches"] > 1,
        f"{got['micro_batches']} micro-batches",
    )
    item.at_most(
        "grad norm, rel diff", scalar_rel(got["grad_norm"], ref["grad_norm"]), TOLERANCES["grad_rel"]
    )
    item.at_most("logprobs after the step, max |diff|", max_abs(got["new"], ref["new"]), lp)
    item.holds("the step changed the policy", max_abs(got["new"], got["old"]) > 1e-4)
