"""Per-model training state: one `TrainingWorker` per Tinker training client.

A LoRA client's worker is built over the base model its `BasePool` holds once for every LoRA
client of that base (`skylift.tinker.training.base_pool`): the client owns its adapter, gradients and
optimizer state only. A full fine-tune (rank 0) loads a model of its own.

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

from skylift.config.schema import OptimizerConfig
from skylift.tinker.core.loss_sampling import loss_distribution
from skylift.tinker.core.model_input import check_token_range
from skylift.tinker.core.wire import ForwardBackwardCall, WireDatum, encode_forward_backward_output
from skylift.tinker.errors import UserError
from skylift.tinker.sampling.weights import ADAPTER_DIR, AdapterSource, SamplerSnapshot
from skylift.tinker.storage.meta import META_FILE
from skylift.tinker.training.base_pool import BasePool
from skylift.tinker.training.datum_batch import TinkerLoss, datums_to_batch
from skylift.tinker.training.losses import RECORDED_LOGPROBS, SAMPLED_MASK, LossSpec, check_config, get_loss
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings

logger = logging.getLogger(__name__)

LORA_ALPHA = 32
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]
PROVENANCE_INPUTS = (RECORDED_LOGPROBS, SAMPLED_MASK)


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

    def __init__(
        self, model_id: str, config: ModelConfig, micro_batch_size: int = 8, pool: BasePool | None = None
    ) -> None:
        self.model_id = model_id
        self.config = config
        self.micro_batch_size = micro_batch_size
        self.worker: TrainingWorker | None = None
        # LoRA: the pool holding the base (a private one when none is given)
        self.pool = (pool or BasePool()) if config.is_lora else None
        self._held: tuple[str, str] | None = None  # (model path, dtype) of the base held in the pool
        self.vocab_size = 0
        self.image_token_id: int | None = None  # vision-language models: the image placeholder token
        self.steps = 0

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        from transformers import AutoConfig

        from skylift.models.moe import is_mixture_of_experts
        from skylift.tinker.training import moe_lora

        c = self.config
        if c.lora_rank < 0:
            raise UserError(f"lora_config.rank must be >= 0 (0 = full fine-tuning), got {c.lora_rank}")
        hf_config = AutoConfig.from_pretrained(c.model_path)
        moe = is_mixture_of_experts(hf_config)
        targets = c.target_modules() if c.is_lora else []
        if moe and c.train_mlp:  # Mixtral's experts by their names before transformers 5 fused them
            targets += moe_lora.MIXTRAL_EXPERT_MODULES
        settings = WorkerSettings(
            model_path=c.model_path,
            lora_rank=c.lora_rank,
            lora_alpha=LORA_ALPHA,
            lora_target_modules=targets if c.is_lora else "all-linear",
            fsdp=False,
            seed=c.seed,
            # the Tinker API sends the hyper-parameters with every step (constant schedule)
            optimizer=OptimizerSettings(
                OptimizerConfig(
                    lr=1e-4, adam_betas=[0.9, 0.95], weight_decay=0.0, max_grad_norm=0.0, scheduler="constant"
                ),
                eps=1e-12,
            ),
        )
        worker = TrainingWorker(settings, rank=0, world_size=1)
        if self.pool is not None:
            base = self.pool.acquire(self.model_id, c.model_path, settings.dtype)
            self._held = (c.model_path, settings.dtype)
            try:
                worker.setup(base=base)
            except Exception:
                self.close()
                raise
        else:
            worker.setup()
        self.worker = worker
        if moe and c.is_lora:
            try:  # one line: what the adapter covers (a refusal where PEFT left the experts out)
                logger.info("%s", moe_lora.describe(c, worker._model(), self.model_id))
            except UserError:
                self.close()
                raise
        self.vocab_size = int(hf_config.get_text_config().vocab_size)
        self.image_token_id = getattr(hf_config, "image_token_id", None)

    def close(self) -> None:
        self.worker = None
        if self.pool is not None and self._held is not None:
            path, dtype = self._held
            self._held = None
            self.pool.release(self.model_id, path, dtype)

    def _worker(self) -> TrainingWorker:
        if self.worker is None:
            raise RuntimeError(f"model {self.model_id} is not set up")
        return self.worker

    # ---------------------------------------------------------------- forward / backward
    def forward_backward(self, call: ForwardBackwardCall) -> bytes:
        """Run the loss over `call.data` on the worker; add gradients unless `forward_only`.

        The logprobs (those the loss reads and those returned) are taken under the sampling
        distribution `loss_fn_config` names (`skylift.tinker.core.loss_sampling`; default: the plain
        softmax). Gradients accumulate across calls until `optim_step`. Returns protobuf."""
        spec = get_loss(call.loss_fn)
        check_config(spec, call.loss_fn_config)
        dist = loss_distribution(call.loss_fn_config)
        if not call.data:
            raise UserError("forward_backward: no data")
        two_d = any(
            d.inputs.get("target_tokens") is not None and d.inputs["target_tokens"].ndim == 2
            for d in call.data
        )
        for i, datum in enumerate(call.data):
            self._check_datum(i, datum, spec, two_d)
        if any(d.pixel_values is not None for d in call.data) and self.image_token_id is None:
            raise UserError(f"{self.config.base_model} is not a vision-language model; it cannot take images")
        names = [
            n
            for n in (*spec.required, *spec.optional, *PROVENANCE_INPUTS)
            if all(n in d.inputs for d in call.data)
        ]
        batch = datums_to_batch(call.data, names, two_d)
        loss = TinkerLoss(spec, names, dict(call.loss_fn_config))
        worker = self._worker()
        if call.forward_only:
            logp = worker.compute_logprobs(batch, self.micro_batch_size, dist)
            with torch.no_grad():
                loss(logp, batch)
            metrics: dict[str, float] = {}
        else:
            metrics = worker.accumulate_gradients(batch, loss, self.micro_batch_size, dist)
        outputs = []
        for j, datum in enumerate(call.data):
            n = len(datum.tokens)
            outputs.append({"logprobs": loss.logprobs[j][:n], "elementwise_loss": loss.per_token[j][:n]})
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["loss:sum"] = loss.total
        return encode_forward_backward_output(outputs, metrics)

    def _check_datum(self, i: int, datum: WireDatum, spec: LossSpec, two_d: bool) -> None:
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
        if two_d and not spec.two_d_targets:
            raise UserError(
                f"datum {i}: loss {spec.name!r} takes 1-D target_tokens; only cross_entropy takes [N, K]"
            )
        targets = datum.inputs["target_tokens"]
        if two_d and (targets.ndim != 2 or targets.shape[0] != n or targets.shape[1] < 1):
            raise UserError(
                f"datum {i}: target_tokens has shape {list(targets.shape)}; with 2-D targets in the batch "
                f"every datum needs [N, K] with N = {n} model_input tokens"
            )
        for name, arr in datum.inputs.items():
            if name not in needed and name not in spec.optional:
                continue
            shapes = [[n]] + (
                [[n, int(targets.shape[1])]] if two_d and name in ("target_tokens", "weights") else []
            )
            if list(arr.shape) not in shapes:
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)} but model_input has "
                    f"{n} tokens (expected shape {' or '.join(str(s) for s in shapes)})"
                )
        check_token_range(
            targets.astype(np.int64).reshape(-1).tolist(), self.vocab_size, f"datum {i} target_tokens"
        )

    # ---------------------------------------------------------------- optimizer
    def optim_step(self, adam: Mapping[str, Any]) -> dict[str, float]:
        """One AdamW step with the request's `adam_params`, then clear the gradients."""
        try:
            lr = float(adam.get("learning_rate", 1e-4))
            betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            eps = float(adam.get("eps", 1e-12))
            weight_decay = float(adam.get("weight_decay", 0.0))
            max_grad_norm = float(adam.get("grad_clip_norm", 0.0))
        except (TypeError, ValueError) as exc:
            raise UserError(f"adam_params: {exc}") from exc
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or weight_decay < 0:
            raise UserError(f"adam_params out of range: {dict(adam)}")
        worker = self._worker()
        assert worker.optimizer is not None
        for group in worker.optimizer.param_groups:  # the Tinker API sends them with every step
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        result = worker.optimizer_step(max_grad_norm=max_grad_norm)
        self.steps += 1
        return {"grad_norm": float(result["grad_norm"]), "learning_rate": lr}

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
        worker.load_checkpoint(str(directory), trainable_only=self.pool is not None)
        if not optimizer and worker.optimizer is not None:
            worker.optimizer.state.clear()

    def export_sampler(self, directory: Path) -> int:
        """A Hugging Face directory with merged weights (what an engine swaps in) and, for a LoRA
        client, its adapter in `adapter/` (what an engine serving many adapters loads); size in bytes."""
        worker = self._worker()
        worker.export_hf(str(directory))
        if self.config.is_lora:
            from skylift.weight_sync.lora.adapter import write_adapter_dir

            tensors, peft_config = worker.lora_adapter()
            write_adapter_dir(str(directory / ADAPTER_DIR), tensors, peft_config)
        (directory / META_FILE).write_text(json.dumps({"model": self.config.to_json(), "steps": self.steps}))
        return _dir_size(directory)

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the current merged weights under the checkpoint's names and layouts (what an
        engine loads: a mixture-of-experts model's fused experts back to one tensor per expert,
        `skylift.models.checkpoint_names`)."""
        from skylift.models.checkpoint_names import checkpoint_names_for

        worker = self._worker()
        model = worker._model()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        names = checkpoint_names_for(base, worker.settings.model_path)
        return {name: tensor.detach().clone() for name, tensor in names.convert(worker.iter_full_weights())}

    def snapshot_sampler(self, with_full: bool = False) -> SamplerSnapshot:
        """A copy of what an ephemeral sampler samples from: a LoRA client's adapter (merged into
        the base on demand), and the merged full weights too where `with_full`; a full fine-tune's
        weights."""
        from skylift.weight_sync.lora.merge import merges_from_tensors

        adapter = None
        if self.config.is_lora:
            tensors, peft_config = self._worker().lora_adapter()
            copies = {name: t.detach().clone() for name, t in tensors}
            adapter = AdapterSource(rank=self.config.lora_rank, tensors=copies, config=peft_config)
        # an adapter of fused experts is merged here, on the model (the sampler's tensors-only
        # merge does not know their layout); its weights are held merged, as a full fine-tune's
        merge_here = adapter is None or not merges_from_tensors(adapter.config or {})
        full = self.snapshot_weights() if with_full or merge_here else None
        return SamplerSnapshot(full, adapter)


def read_checkpoint_config(directory: Path) -> ModelConfig:
    """The `ModelConfig` stored beside a checkpoint."""
    meta = directory / META_FILE
    if not meta.is_file():
        raise UserError(f"checkpoint at {directory} has no {META_FILE}; it was not written by this server")
    return ModelConfig.from_json(json.loads(meta.read_text())["model"])


def _dir_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
