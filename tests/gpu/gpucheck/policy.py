"""Items 1 and 2: one policy step of `TrainingWorker` (forward, backward, AdamW step).

`policy_step` is what both phases run: logprobs of a fixed batch, the gradient of a fixed
advantage-weighted loss accumulated over two micro-batches, one optimizer step, logprobs again.
Item 1 runs it unsharded in every precision and with LoRA, on both models; item 2 runs it on
SmolLM2 under FSDP2 on a world-size-1 process group (NCCL on CUDA) with gradient checkpointing,
and compares with item 1's unsharded CPU reference.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gpucheck.device import Context, peak_label, peak_memory_mb, reset_peak_memory
from gpucheck.models import long_batch, policy_batch
from gpucheck.report import Item, limit_for, max_abs, rel_err, scalar_rel
from skylift.config.schema import OptimizerConfig
from skylift.worker.batch import SequenceBatch
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

LR = 1e-4
ADVANTAGES = (1.0, -0.5, 0.75, -0.25)
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16-mixed": {"compute_dtype": "bfloat16"},  # float32 weights, bfloat16 matmuls (trainer.bf16)
    "bf16": {"dtype": "bfloat16"},  # bfloat16 weights and optimizer state
    "lora-fp32": {"lora_rank": 8, "lora_alpha": 16},
    "lora-bf16-mixed": {"lora_rank": 8, "lora_alpha": 16, "compute_dtype": "bfloat16"},
}
# the float32 configuration whose CPU result measures how far bfloat16 moves the numbers
CALIBRATED_BY = {"bf16-mixed": "fp32", "bf16": "fp32", "lora-bf16-mixed": "lora-fp32"}
FSDP_CONFIGS = ("fp32", "bf16-mixed")


class AdvantageLoss:
    """-sum(advantage * logprob) over response tokens / tokens of the whole batch."""

    def __init__(self, token_count: float) -> None:
        self.token_count = token_count

    def __call__(self, logp: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict]:
        mask = micro.response_mask.to(logp.dtype)
        adv = micro.extras["advantage"].to(logp.dtype)[:, None]
        loss = -(adv * logp * mask).sum() / self.token_count
        return loss, {"loss": float(loss.detach())}


def batch_for(vocab_size: int) -> SequenceBatch:
    batch = policy_batch(vocab_size)
    return batch.with_extras(advantage=torch.tensor(ADVANTAGES))


def objective_value(logp: Tensor, batch: SequenceBatch) -> float:
    adv = batch.extras["advantage"][:, None]
    return float(-(adv * logp * batch.response_mask).sum() / batch.response_mask.sum())


def settings_for(model_dir: Path, config: str, **extra: Any) -> WorkerSettings:
    return WorkerSettings(
        model_path=str(model_dir),
        optimizer=OptimizerSettings(
            OptimizerConfig(lr=LR, max_grad_norm=1e9, scheduler="constant", weight_decay=0.0)
        ),
        seed=7,
        **CONFIGS[config],
        **extra,
    )


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _picked(names: list[str], layers: int) -> list[str]:
    """The parameters whose whole gradients are compared: first attention, last MLP (a mixture of
    experts': its fused experts and router), final norm, a vision tower's patch embedding."""
    last = f"layers.{layers - 1}.mlp"
    wanted = ["layers.0.self_attn.q_proj", f"{last}.down_proj", f"{last}.experts.down_proj", f"{last}.gate."]
    wanted += ["model.norm.weight", "language_model.norm.weight", "visual.patch_embed."]
    return [n for n in names if any(w in n for w in wanted)]


def _layers(config: Any) -> int:
    """Decoder layers of a model's config (a vision-language model's: its text config's)."""
    layers = getattr(config, "num_hidden_layers", None)
    text = getattr(config, "text_config", None)
    return int(layers or getattr(text, "num_hidden_layers", None) or 1)


def policy_step(settings: WorkerSettings, batch: SequenceBatch, **worker_args: Any) -> dict[str, Any]:
    """Run one step and return what the comparison needs (CPU tensors and floats)."""
    reset_peak_memory()
    worker = TrainingWorker(settings, **worker_args)
    try:
        worker.setup()
        model = worker.model
        assert model is not None and worker.optimizer is not None
        layers = _layers(model.config)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        names = [n for n, _ in trainable]
        picked = _picked(names, layers)
        lp0 = worker.compute_logprobs(batch, micro_batch_size=4)
        worker.zero_grad()
        metrics = worker.accumulate_gradients(batch, AdvantageLoss(float(batch.response_mask.sum())), 2)
        grads = {n: _full(p.grad).detach().float() for n, p in trainable if p.grad is not None}
        grad_norms = torch.tensor([float(grads[n].norm()) if n in grads else 0.0 for n in names])
        picked_grads = {n: grads[n].cpu().clone() for n in picked if n in grads}
        del grads
        frozen_probe = [(n, _full(p).detach().float().cpu().clone()) for n, p in frozen[:3]]
        before = {n: _full(p).detach().float().cpu().clone() for n, p in trainable if n in picked}
        step = worker.optimizer_step()
        moved = {
            n: float((_full(p).detach().float().cpu() - before[n]).norm())
            for n, p in trainable
            if n in before
        }
        frozen_moved = max(
            (float((_full(p).detach().float().cpu() - dict(frozen_probe)[n]).norm()) for n, p in frozen[:3]),
            default=0.0,
        )
        lp1 = worker.compute_logprobs(batch, micro_batch_size=4)
        params = list(model.parameters())
        return {
            "names": names,
            "lp0": lp0,
            "lp1": lp1,
            "loss": metrics["loss"],
            "objective_before": objective_value(lp0, batch),
            "objective_after": objective_value(lp1, batch),
            "grad_norm": step["grad_norm"],
            "grad_norms": grad_norms,
            "picked_grads": picked_grads,
            "moved": moved,
            "frozen_moved": frozen_moved,
            "trainable": len(trainable),
            "frozen": len(frozen),
            "lora_only": all("lora_" in n for n in names),
            "fused_adamw": bool(worker.optimizer.defaults.get("fused")),
            "sharded": any(type(p).__name__ == "DTensor" for p in params),
            "device": str(worker.device),
            "peak_mb": peak_memory_mb(),
            "_worker": worker,
        }
    except BaseException:
        worker.shutdown()
        raise


def strip(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def reference_step(path: Path, config: str, batch: SequenceBatch, label: str) -> dict[str, Any]:
    """One CPU reference step of `config` (the worker shut down, its time printed as `label`)."""
    started = time.perf_counter()
    result = policy_step(settings_for(path, config), batch)
    result.pop("_worker").shutdown()
    print(f"  cpu reference {label}: {time.perf_counter() - started:.1f} s", flush=True)
    return strip(result)


def grad_norms_rel(a: Tensor, b: Tensor) -> float:
    """Largest per-parameter gradient-norm difference, relative to max(own norm, 1e-3 x largest)."""
    if a.shape != b.shape:
        return math.inf
    floor = 1e-3 * float(b.max()) if b.numel() else 0.0
    return float(((a - b).abs() / b.clamp(min=max(floor, 1e-30))).max()) if b.numel() else 0.0


def compare(
    item: Item, tag: str, got: dict[str, Any], ref: dict[str, Any], cal: dict[str, Any] | None
) -> None:
    """Device result `got` vs CPU reference `ref`; `cal` (CPU float32 of the same model) calibrates bf16."""

    def lim(kind: str, measure: float | None) -> float:
        return limit_for(kind, measure)

    c_lp0 = max_abs(ref["lp0"], cal["lp0"]) if cal else None
    c_lp1 = max_abs(ref["lp1"], cal["lp1"]) if cal else None
    c_loss = scalar_rel(ref["loss"], cal["loss"]) if cal else None
    c_gn = scalar_rel(ref["grad_norm"], cal["grad_norm"]) if cal else None
    c_gns = grad_norms_rel(ref["grad_norms"], cal["grad_norms"]) if cal else None
    item.holds(f"{tag}: same trainable parameters", got["names"] == ref["names"])
    item.at_most(
        f"{tag}: logprobs before step, max |diff|",
        max_abs(got["lp0"], ref["lp0"]),
        lim("logprobs_abs", c_lp0),
    )
    item.at_most(f"{tag}: loss, rel diff", scalar_rel(got["loss"], ref["loss"]), lim("loss_rel", c_loss))
    item.at_most(
        f"{tag}: total grad norm, rel diff",
        scalar_rel(got["grad_norm"], ref["grad_norm"]),
        lim("grad_rel", c_gn),
    )
    item.at_most(
        f"{tag}: per-parameter grad norms, max rel diff",
        grad_norms_rel(got["grad_norms"], ref["grad_norms"]),
        lim("grad_rel", c_gns),
    )
    for name, g in ref["picked_grads"].items():
        c = rel_err(g, cal["picked_grads"][name]) if cal and name in cal["picked_grads"] else None
        item.at_most(
            f"{tag}: grad {name}, rel err", rel_err(got["picked_grads"][name], g), lim("grad_rel", c)
        )
    item.at_most(
        f"{tag}: logprobs after step, max |diff|", max_abs(got["lp1"], ref["lp1"]), lim("logprobs_abs", c_lp1)
    )
    item.holds(
        f"{tag}: the step lowers the loss",
        got["objective_after"] < got["objective_before"],
        f"{got['objective_before']:.6f} -> {got['objective_after']:.6f}",
    )
    item.holds(
        f"{tag}: gradients finite and non-zero", math.isfinite(got["grad_norm"]) and got["grad_norm"] > 0
    )
    if "lora" in tag:
        item.holds(f"{tag}: only LoRA parameters train", got["lora_only"] and got["frozen"] > 0)
        item.at_most(f"{tag}: frozen base weights moved", got["frozen_moved"], 0.0)


def long_batch_peak_mb(worker: TrainingWorker, vocab_size: int) -> float:
    """Peak CUDA memory of a backward pass over 4 x 1024 tokens above what was allocated before."""
    batch = long_batch(vocab_size, rows=4, length=1024).with_extras(advantage=torch.ones(4))
    worker.zero_grad()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() / 2**20
    torch.cuda.reset_peak_memory_stats()
    worker.accumulate_gradients(batch, AdvantageLoss(float(batch.response_mask.sum())), 4)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20 - base
    worker.zero_grad()
    return round(peak, 1)


# ---------------------------------------------------------------- the two phases
def reference(ctx: Context) -> dict[str, Any]:
    """CPU results of every configuration of items 1 and 2 (they share these)."""
    refs: dict[str, Any] = {}
    for model, path in ctx.models.items():
        batch = batch_for(ctx.vocab_size(model))
        for config in CONFIGS:
            refs[f"policy/{model}/{config}"] = reference_step(path, config, batch, f"{model}/{config}")
    return refs


def item_policy(ctx: Context, refs: dict[str, Any], item: Item, keep: dict[str, Any]) -> None:
    """Item 1: every configuration on the device vs the same on CPU."""
    for model, path in ctx.models.items():
        batch = batch_for(ctx.vocab_size(model))
        for config in CONFIGS:
            tag = f"{model}/{config}"
            started = time.perf_counter()
            got = policy_step(settings_for(path, config), batch)
            worker = got.pop("_worker")
            cal = refs[f"policy/{model}/{CALIBRATED_BY[config]}"] if config in CALIBRATED_BY else None
            compare(item, tag, got, refs[f"policy/{tag}"], cal)
            item.figures[f"{tag} {peak_label()}"] = got["peak_mb"]
            if config in CALIBRATED_BY:  # the calibration itself: bf16 vs fp32, both on CPU
                ref = refs[f"policy/{tag}"]
                item.figures[f"{tag} vs float32 on CPU: logprobs max |diff|"] = round(
                    max_abs(ref["lp0"], cal["lp0"]), 6
                )
            if (model, config) == ("smollm2-135m", "fp32"):
                item.figures["fused AdamW (unsharded)"] = got["fused_adamw"]
                item.holds(f"{tag}: AdamW is fused", got["fused_adamw"])
                keep["fused_adamw"] = got["fused_adamw"]
                if torch.cuda.is_available():
                    keep["no_gc_long_peak_mb"] = long_batch_peak_mb(worker, ctx.vocab_size(model))
            worker.shutdown()
            del worker
            item.figures[f"{tag} device"] = got["device"]
            print(f"  {got['device']} {tag}: {time.perf_counter() - started:.1f} s", flush=True)


def item_fsdp(ctx: Context, refs: dict[str, Any], item: Item, keep: dict[str, Any]) -> None:
    """Item 2: SmolLM2 under FSDP2 (world size 1) with gradient checkpointing vs unsharded CPU."""
    import torch.distributed as dist

    model = "smollm2-135m"
    batch = batch_for(ctx.vocab_size(model))
    for config in FSDP_CONFIGS:
        tag = f"{model}/{config}/fsdp2+gc"
        rendezvous = ctx.work / f"rdzv-fsdp-{config}"
        rendezvous.unlink(missing_ok=True)
        settings = settings_for(ctx.smollm2_dir, config, fsdp=True, gradient_checkpointing=True)
        got = policy_step(settings, batch, rank=0, world_size=1, init_method=f"file://{rendezvous}")
        worker = got.pop("_worker")
        try:
            backend = dist.get_backend() if dist.is_initialized() else "none"
            want = "nccl" if torch.cuda.is_available() else "gloo"
            item.holds(f"{tag}: process group backend is {want}", backend == want, f"got {backend}")
            item.holds(f"{tag}: parameters are sharded (DTensor)", got["sharded"])
            item.holds(f"{tag}: gradient checkpointing on", bool(worker.model.is_gradient_checkpointing))
            cal = refs[f"policy/{model}/{CALIBRATED_BY[config]}"] if config in CALIBRATED_BY else None
            compare(item, tag, got, refs[f"policy/{model}/{config}"], cal)
            item.figures[f"{tag} {peak_label()}"] = got["peak_mb"]
            if torch.cuda.is_available() and config == "fp32":
                peak = long_batch_peak_mb(worker, ctx.vocab_size(model))
                item.figures["4x1024-token backward, peak MiB above weights: no GC (unsharded)"] = keep.get(
                    "no_gc_long_peak_mb"
                )
                item.figures["4x1024-token backward, peak MiB above weights: FSDP2 + GC"] = peak
                if keep.get("no_gc_long_peak_mb"):
                    item.holds(
                        "gradient checkpointing lowers the activation peak", peak < keep["no_gc_long_peak_mb"]
                    )
        finally:
            worker.shutdown()
    if "fused_adamw" in keep:
        item.figures["fused AdamW on the unsharded path"] = keep["fused_adamw"]
