"""Item 4: one GRPO update (experience -> loss -> step) from rollouts saved on CPU.

The reference phase samples the rollouts on CPU with the tiny model (4 prompts x 4 samples, its own
sampling loop, so the rollout logprobs are those of the distribution sampled from) and saves them as
`rollouts.json`; both phases then run the trainer's own pure steps on that file:
`skylift.rl.experience.make_experience` (batch, GRPO advantages from a rule-based reward, old
and reference logprobs from the workers) and `skylift.rl.update.train_policy` (one mini-batch,
PPO-clip + k3 KL loss, four micro-batches), then score the batch again.

`skylift.config/__init__` imports omegaconf, which the GPU machine lacks; the trainer modules need
only `skylift.config.schema` (dataclasses), so the package __init__ is skipped where it fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpucheck.device import Context
from gpucheck.env import import_skipping_package_init
from gpucheck.report import TOLERANCES, Item, max_abs, scalar_rel
from skylift.config.algorithm import AlgorithmConfig
from skylift.config.schema import OptimizerConfig
from skylift.rl.objective import PolicyObjective
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

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


class _LossRecorder:
    """The policy worker as `train_policy` sees it, remembering every micro-batch loss it trains."""

    def __init__(self, worker: TrainingWorker) -> None:
        self.worker = worker
        self.world_size = worker.world_size
        self.losses: list[float] = []

    def train_mini_batch(self, batch: Any, loss_fn: Any, micro_batch_size: int, temperature: float) -> dict:
        def recorded(logprobs: Any, micro: Any) -> Any:
            loss, metrics = loss_fn(logprobs, micro)
            self.losses.append(float(loss.detach()))
            return loss, metrics

        return self.worker.train_mini_batch(batch, recorded, micro_batch_size, temperature)


def trainer_modules() -> tuple[Any, Any, str | None]:
    """(skylift.rl.experience, skylift.rl.update, why skylift.config/__init__ was skipped)."""
    _, why = import_skipping_package_init("skylift.config.schema", "skylift.config")
    import skylift.rl.experience as experience
    import skylift.rl.update as update

    return experience, update, why


def grpo_update(model_dir: Path, rollouts: dict[str, Any]) -> dict[str, Any]:
    from skylift.generator.trajectory import Trajectory

    experience, update, skipped = trainer_modules()
    trajectories = [
        Trajectory(
            uid=uid,
            prompt_ids=prompt,
            response_ids=response,
            loss_mask=[1] * len(response),
            rollout_logprobs=logprobs,
            reward=reward,
            stop_reason="stop",
        )
        for uid, prompt, response, logprobs, reward in zip(
            rollouts["uids"],
            rollouts["prompts"],
            rollouts["responses"],
            rollouts["rollout_logprobs"],
            rollouts["rewards"],
            strict=True,
        )
    ]
    settings = WorkerSettings(
        model_path=str(model_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1e-3, scheduler="constant", weight_decay=0.0)),
        seed=5,
    )
    policy = TrainingWorker(settings)
    ref = TrainingWorker(WorkerSettings(model_path=str(model_dir), trainable=False))
    policy.setup()
    ref.setup()
    from skylift.rl.staleness import StalenessPolicy  # skylift.config/__init__ handled above

    exp = experience.make_experience(
        trajectories,
        experience.ExperienceStages.of(  # GRPO (the trainer.algorithm defaults)
            staleness=StalenessPolicy(old_logprobs="trainer"), pad_token_id=rollouts["pad_token_id"]
        ),
        policy_version=0,
        policy_logprobs=lambda b: policy.compute_logprobs(b, 8),
        ref_logprobs=lambda b: ref.compute_logprobs(b, 8),
    )
    batch = exp.batch
    objective = PolicyObjective(
        AlgorithmConfig(
            policy_loss_type="regular", loss_reduction="token_mean", use_kl_loss=True, kl_loss_coef=0.01
        )
    )
    recorder = _LossRecorder(policy)
    rows = batch.batch_size
    metrics = update.train_policy(
        recorder,
        batch,
        objective,
        update.UpdateSettings(rows_per_mini_batch=rows, critic_rows_per_mini_batch=rows, micro_batch_size=4),
    )
    new = policy.compute_logprobs(batch, 8)
    out = {
        "advantages": batch.extras["advantages"],
        "old": batch.extras["old_logprobs"],
        "ref": batch.extras["ref_logprobs"],
        "new": new,
        "loss": sum(recorder.losses),
        "micro_batches": len(recorder.losses),
        "policy_loss": metrics["policy/policy_loss"],
        "grad_norm": metrics["policy/grad_norm"],
        "vs_rollout": exp.metrics["policy/logprob_diff_vs_rollout"],
        "reward_mean": exp.metrics["reward/mean"],
        "device": str(policy.device),
        "rows": rows,
        "tokens": int(batch.response_mask.sum()),
        "skipped_config_init": skipped,
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
    item.figures["mean reward"] = round(got["reward_mean"], 4)
    item.figures["imported without skylift.config/__init__"] = (
        got["skipped_config_init"] or "no (it imports here)"
    )
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
    item.at_most(
        "policy-loss metric, rel diff",
        scalar_rel(got["policy_loss"], ref["policy_loss"]),
        TOLERANCES["loss_rel"],
    )
    item.at_most("logprobs after the step, max |diff|", max_abs(got["new"], ref["new"]), lp)
    item.holds("the step changed the policy", max_abs(got["new"], got["old"]) > 1e-4)
