"""Item 5: the Tinker training path — `TrainedModel.forward_backward` and `optim_step`, no HTTP.

Two calls of the backend that the REST service queues (cross_entropy, then importance_sampling,
gradients adding up), one AdamW step with the request's hyper-parameters, and a forward pass
after it; LoRA (rank 8) and full fine-tuning, on the tiny model. Outputs are decoded from the
protobuf bytes the backend returns to the SDK.

The GPU machine has neither FastAPI nor the tinker SDK's dependencies: `skylift.tinker/__init__`
imports the FastAPI app and `tinker/__init__` imports pydantic. Where importing a package's
`__init__` fails, the needed modules are imported without it (`env.import_skipping_package_init`),
and the report says why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpucheck.device import Context
from gpucheck.env import import_skipping_package_init, why_blocked
from gpucheck.report import TOLERANCES, Item, max_abs, scalar_rel

LR = 1e-3
SEED = 21


def load_backend() -> tuple[Any, Any, Any, dict[str, str | None]]:
    """(skylift.tinker.training.trained_model, skylift.tinker.core.wire, tinker.proto.tinker_public_pb2, skipped inits)."""
    pb, tinker_why = import_skipping_package_init("tinker.proto.tinker_public_pb2", "tinker")
    backend, skylift_why = import_skipping_package_init(
        "skylift.tinker.training.trained_model", "skylift.tinker"
    )
    skipped = {"tinker": tinker_why, "skylift.tinker": skylift_why}
    return backend, sys.modules["skylift.tinker.core.wire"], pb, skipped


def _datums(wire: Any, vocab: int, logprobs: list[np.ndarray] | None) -> list[Any]:
    g = torch.Generator().manual_seed(SEED)
    data = []
    for i, (n, prompt) in enumerate(((20, 8), (14, 5), (9, 3))):
        seq = torch.randint(3, vocab, (n + 1,), generator=g).numpy().astype(np.int64)
        weights = np.zeros(n, dtype=np.float32)
        weights[prompt:] = 1.0
        inputs = {"target_tokens": seq[1:], "weights": weights}
        if logprobs is not None:
            inputs = {
                "target_tokens": seq[1:],
                "logprobs": (logprobs[i] - 0.1).astype(np.float32),
                "advantages": np.where(np.arange(n) >= prompt, 1.0 if i % 2 == 0 else -0.5, 0.0).astype(
                    np.float32
                ),
            }
        data.append(wire.WireDatum(tokens=seq[:-1].tolist(), inputs=inputs))
    return data


def _decode(pb: Any, body: bytes) -> tuple[list[np.ndarray], dict[str, float]]:
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(body)
    field = msg.loss_fn_outputs[0].fields["logprobs"]
    data = np.frombuffer(field.data, dtype=np.float32)
    offsets = np.frombuffer(field.offsets, dtype=np.int64) // 4
    return [data[a:b].copy() for a, b in zip(offsets[:-1], offsets[1:], strict=True)], dict(msg.metrics)


def tinker_steps(model_dir: Path, lora_rank: int) -> dict[str, Any]:
    backend, wire, pb, skipped = load_backend()
    config = backend.ModelConfig(
        base_model="tiny-qwen2", model_path=str(model_dir), lora_rank=lora_rank, seed=SEED
    )
    model = backend.TrainedModel("gpu-check", config, micro_batch_size=2)
    model.setup()

    def call(loss_fn: str, data: list[Any], forward_only: bool = False) -> tuple[list[np.ndarray], dict]:
        fb = wire.ForwardBackwardCall(
            model_id="gpu-check", seq_id=1, loss_fn=loss_fn, forward_only=forward_only, data=data
        )
        return _decode(pb, model.forward_backward(fb))

    sft = _datums(wire, model.vocab_size, None)
    lp0, m_ce = call("cross_entropy", sft)
    lp_is, m_is = call("importance_sampling", _datums(wire, model.vocab_size, lp0))
    step = model.optim_step({"learning_rate": LR, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12})
    lp1, m_after = call("cross_entropy", sft, forward_only=True)
    device = str(model.worker.device) if model.worker is not None else "?"
    model.close()
    return {
        "lp0": torch.from_numpy(np.concatenate(lp0)),
        "lp_is": torch.from_numpy(np.concatenate(lp_is)),
        "lp1": torch.from_numpy(np.concatenate(lp1)),
        "ce_loss": float(m_ce["loss:sum"]),
        "is_loss": float(m_is["loss:sum"]),
        "ce_after": float(m_after["loss:sum"]),
        "grad_norm": float(step["grad_norm"]),
        "device": device,
        "skipped_inits": skipped,
    }


MODES = {"lora-8": 8, "full": 0}


def importable() -> str | None:
    """None when the backend imports here, else which module pulled in what is missing."""
    try:
        load_backend()
    except ImportError as exc:
        return f"skylift.tinker.training.trained_model cannot be imported: {why_blocked(exc)}"
    return None


def reference(ctx: Context) -> dict[str, Any]:
    missing = importable()
    if missing:
        return {"tinker/skipped": missing}
    return {f"tinker/{mode}": tinker_steps(ctx.tiny_dir, rank) for mode, rank in MODES.items()}


def item_tinker(ctx: Context, refs: dict[str, Any], item: Item) -> None:
    missing = importable() or refs.get("tinker/skipped")
    if missing:
        item.skipped = missing
        return
    lp, loss, grad = TOLERANCES["logprobs_abs"], TOLERANCES["loss_rel"], TOLERANCES["grad_rel"]
    for mode, rank in MODES.items():
        got, ref = tinker_steps(ctx.tiny_dir, rank), refs[f"tinker/{mode}"]
        item.figures[f"{mode} device"] = got["device"]
        item.at_most(f"{mode}: forward_backward logprobs, max |diff|", max_abs(got["lp0"], ref["lp0"]), lp)
        item.at_most(
            f"{mode}: cross_entropy loss:sum, rel diff", scalar_rel(got["ce_loss"], ref["ce_loss"]), loss
        )
        item.at_most(
            f"{mode}: importance_sampling loss:sum, rel diff",
            scalar_rel(got["is_loss"], ref["is_loss"]),
            loss,
        )
        item.at_most(
            f"{mode}: optim_step grad norm, rel diff", scalar_rel(got["grad_norm"], ref["grad_norm"]), grad
        )
        item.at_most(f"{mode}: logprobs after optim_step, max |diff|", max_abs(got["lp1"], ref["lp1"]), lp)
        item.holds(
            f"{mode}: optim_step lowered the cross-entropy",
            got["ce_after"] < got["ce_loss"],
            f"{got['ce_loss']:.4f} -> {got['ce_after']:.4f}",
        )
    for package, why in got["skipped_inits"].items():
        item.figures[f"imported without {package}/__init__"] = why or "no (the package imports here)"
