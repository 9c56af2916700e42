"""Per-model training state: one `TrainingWorker` per Tinker training client.

`TrainedModel` turns Tinker operations into worker calls: forward / forward_backward with a named
loss (gradients accumulate across calls until `optim_step`), AdamW steps with the request's
hyper-parameters, checkpoints (model + optimizer) and exports of merged weights for sampling.
Nothing here touches an inference engine. Methods are blocking; the service runs them on its
single training thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from skylift.tinker.errors import UserError
from skylift.tinker.losses import LossSpec, get_loss
from skylift.tinker.rendering import check_token_range
from skylift.tinker.wire import ForwardBackwardCall, WireDatum, encode_forward_backward_output
from skylift.training.logprobs import gather_logprobs
from skylift.training.worker import OptimizerSettings, TrainingWorker, WorkerSettings

logger = logging.getLogger(__name__)

LORA_ALPHA = 32
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]
META_FILE = "skylift_tinker_meta.json"


@dataclass
class ModelConfig:
    """What a training model is: base model, LoRA settings (rank 0 = full fine-tuning)."""

    base_model: str  # as the client named it
    model_path: str  # resolved local directory
    lora_rank: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    def target_modules(self) -> list[str]:
        modules: list[str] = []
        if self.train_attn:
            modules += ATTN_MODULES
        if self.train_mlp:
            modules += MLP_MODULES
        if self.train_unembed:
            modules += UNEMBED_MODULES
        if not modules:
            raise UserError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        return modules

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelConfig:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class TrainedModel:
    """One trainable model (a Tinker training run) held in memory."""

    def __init__(self, model_id: str, config: ModelConfig, micro_batch_size: int = 8) -> None:
        self.model_id = model_id
        self.config = config
        self.micro_batch_size = micro_batch_size
        self.worker: TrainingWorker | None = None
        self.vocab_size = 0
        self.image_token_id: int | None = None  # vision-language models: the image placeholder token
        self.steps = 0

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        from transformers import AutoConfig

        c = self.config
        if c.lora_rank < 0:
            raise UserError(f"lora_config.rank must be >= 0 (0 = full fine-tuning), got {c.lora_rank}")
        settings = WorkerSettings(
            model_path=c.model_path,
            lora_rank=c.lora_rank,
            lora_alpha=LORA_ALPHA,
            lora_target_modules=c.target_modules() if c.is_lora else "all-linear",
            fsdp=False,
            seed=c.seed,
            optimizer=OptimizerSettings(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, max_grad_norm=0.0),
        )
        worker = TrainingWorker(settings, rank=0, world_size=1)
        worker.setup()
        self.worker = worker
        hf_config = AutoConfig.from_pretrained(c.model_path)
        self.vocab_size = int(hf_config.get_text_config().vocab_size)
        self.image_token_id = getattr(hf_config, "image_token_id", None)

    def close(self) -> None:
        self.worker = None

    def _worker(self) -> TrainingWorker:
        if self.worker is None:
            raise RuntimeError(f"model {self.model_id} is not set up")
        return self.worker

    # ---------------------------------------------------------------- forward / backward
    def forward_backward(self, call: ForwardBackwardCall) -> bytes:
        """Run the loss over `call.data`; add gradients unless `forward_only`. Returns protobuf."""
        spec = get_loss(call.loss_fn)
        if not call.data:
            raise UserError("forward_backward: no data")
        for i, datum in enumerate(call.data):
            self._check_datum(i, datum, spec)
        worker = self._worker()
        model = worker.model
        assert model is not None
        model.train(not call.forward_only)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        metric_sums: dict[str, float] = {}
        order = list(range(len(call.data)))
        for start in range(0, len(order), self.micro_batch_size):
            rows = [call.data[i] for i in order[start : start + self.micro_batch_size]]
            loss, logp, per_token, metrics = self._micro(
                model, rows, spec, call, backward=not call.forward_only
            )
            total += loss
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v * len(rows)
            for j, datum in enumerate(rows):
                n = len(datum.tokens)
                outputs.append({"logprobs": logp[j, :n], "elementwise_loss": per_token[j, :n]})
        metrics_out = {k: v / len(call.data) for k, v in metric_sums.items()}
        metrics_out["loss:sum"] = total
        return encode_forward_backward_output(outputs, metrics_out)

    def _check_datum(self, i: int, datum: WireDatum, spec: LossSpec) -> None:
        n = len(datum.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        check_token_range(datum.tokens, self.vocab_size, f"datum {i} model_input")
        needed = ("target_tokens", *spec.required)
        for name in needed:
            if name not in datum.inputs:
                raise UserError(
                    f"datum {i}: loss {spec.name!r} needs loss_fn_inputs {list(needed)}, "
                    f"got {sorted(datum.inputs)}"
                )
        for name, arr in datum.inputs.items():
            if name not in needed and name not in spec.optional:
                continue
            if arr.ndim != 1 or arr.shape[0] != n:
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)} but model_input has "
                    f"{n} tokens (expected shape [{n}])"
                )
        check_token_range(
            datum.inputs["target_tokens"].astype(np.int64).tolist(),
            self.vocab_size,
            f"datum {i} target_tokens",
        )

    def _micro(
        self,
        model: torch.nn.Module,
        rows: list[WireDatum],
        spec: LossSpec,
        call: ForwardBackwardCall,
        backward: bool,
    ) -> tuple[float, np.ndarray, np.ndarray, dict[str, float]]:
        b, t = len(rows), max(len(d.tokens) for d in rows)
        ids = torch.zeros((b, t), dtype=torch.long)
        attention = torch.zeros((b, t), dtype=torch.long)
        targets = torch.zeros((b, t), dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.float32)
        names = [n for n in (*spec.required, *spec.optional) if all(n in d.inputs for d in rows)]
        extra = {name: torch.zeros((b, t), dtype=torch.float32) for name in names}
        for j, d in enumerate(rows):
            n = len(d.tokens)
            ids[j, :n] = torch.as_tensor(d.tokens, dtype=torch.long)
            attention[j, :n] = 1
            targets[j, :n] = torch.as_tensor(d.inputs["target_tokens"].astype(np.int64))
            mask[j, :n] = 1.0
            for name in names:
                extra[name][j, :n] = torch.as_tensor(d.inputs[name].astype(np.float32))
        device = self._worker().device
        ids, attention, targets, mask = (x.to(device) for x in (ids, attention, targets, mask))
        extra = {k: v.to(device) for k, v in extra.items()}
        vision = _vision_inputs(rows, device)
        if vision and self.image_token_id is None:
            raise UserError(f"{self.config.base_model} is not a vision-language model; it cannot take images")
        if vision:  # which positions hold image tokens (for the multimodal rotary positions)
            vision["mm_token_type_ids"] = (ids == self.image_token_id).long()
        with torch.set_grad_enabled(backward):
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False, **vision).logits
            logp = gather_logprobs(logits, targets) * mask
            per_token, metrics = spec.impl(logp, extra, mask, call.loss_fn_config)
            loss = per_token.sum()
            if backward:
                loss.backward()
        return (
            float(loss.detach()),
            logp.detach().float().cpu().numpy(),
            per_token.detach().float().cpu().numpy(),
            metrics,
        )

    # ---------------------------------------------------------------- optimizer
    def optim_step(self, adam: Mapping[str, Any]) -> dict[str, float]:
        """One AdamW step with the request's `adam_params`, then clear the gradients."""
        try:
            params = {
                "lr": float(adam.get("learning_rate", 1e-4)),
                "beta1": float(adam.get("beta1", 0.9)),
                "beta2": float(adam.get("beta2", 0.95)),
                "eps": float(adam.get("eps", 1e-12)),
                "weight_decay": float(adam.get("weight_decay", 0.0)),
                "max_grad_norm": float(adam.get("grad_clip_norm", 0.0)),
            }
        except (TypeError, ValueError) as exc:
            raise UserError(f"adam_params: {exc}") from exc
        if params["lr"] < 0 or not (0 <= params["beta1"] < 1 and 0 <= params["beta2"] < 1):
            raise UserError(f"adam_params out of range: {dict(adam)}")
        result = self._worker().optimizer_step(adam=params)
        self.steps += 1
        return {"grad_norm": float(result["grad_norm"]), "learning_rate": float(result["lr"])}

    # ---------------------------------------------------------------- checkpoints
    def save_state(self, directory: Path) -> int:
        """Model and optimizer state into `directory`; returns its size in bytes."""
        directory.mkdir(parents=True, exist_ok=True)
        self._worker().save_checkpoint(str(directory))
        (directory / META_FILE).write_text(json.dumps({"model": self.config.to_json(), "steps": self.steps}))
        return _dir_size(directory)

    def load_state(self, directory: Path, optimizer: bool) -> None:
        """Load a `save_state` checkpoint; without `optimizer` the optimizer starts fresh."""
        worker = self._worker()
        worker.load_checkpoint(str(directory))
        if not optimizer and worker.optimizer is not None:
            worker.optimizer.state.clear()

    def export_sampler(self, directory: Path) -> int:
        """A Hugging Face directory with merged weights (what an engine loads); size in bytes."""
        self._worker().export_hf(str(directory))
        (directory / META_FILE).write_text(json.dumps({"model": self.config.to_json(), "steps": self.steps}))
        return _dir_size(directory)

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the current merged Hugging Face-named weights."""
        return {name: tensor.detach().clone() for name, tensor in self._worker().iter_full_weights()}


def _vision_inputs(rows: list[WireDatum], device: torch.device) -> dict[str, torch.Tensor]:
    """`pixel_values` / `image_grid_thw` of the rows' images, in row order (empty without images)."""
    pixels = [d.pixel_values for d in rows if d.pixel_values is not None]
    grids = [d.image_grid_thw for d in rows if d.image_grid_thw is not None]
    if not pixels:
        return {}
    return {
        "pixel_values": torch.cat(pixels).to(device),
        "image_grid_thw": torch.cat(grids).to(device),
    }


def read_checkpoint_config(directory: Path) -> ModelConfig:
    """The `ModelConfig` stored beside a checkpoint."""
    meta = directory / META_FILE
    if not meta.is_file():
        raise UserError(f"checkpoint at {directory} has no {META_FILE}; it was not written by this server")
    return ModelConfig.from_json(json.loads(meta.read_text())["model"])


def _dir_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
