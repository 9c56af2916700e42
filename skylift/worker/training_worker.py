"""A training worker: one rank of an FSDP2-sharded transformers model.

The same class serves as policy (trainable), reference (frozen) and, with a value head, critic.
It knows nothing about RL algorithms: it runs forward passes, backpropagates whatever loss
function it is given over micro-batches, and steps its optimizer. The trainer places one worker
per rank (as Ray actors) and drives them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from skylift.algorithms.sample_support import Sampling, as_distribution
from skylift.utils.dtypes import FLOAT_DTYPES, str_to_dtype
from skylift.worker.batch import SequenceBatch
from skylift.worker.checkpoint_match import checkpoint_shapes, model_mismatch
from skylift.worker.distributed import device_for_rank, init_training_group
from skylift.worker.logprobs import response_logprobs, response_values
from skylift.worker.lora import add_lora, merged_lora_weights
from skylift.worker.micro_batches import (
    micro_batch_rows,
    packed_response_logprobs,
    packed_response_values,
)
from skylift.worker.optim import OptimizerSettings, clipped_step, make_lr_scheduler
from skylift.worker.prefix_tree import prefix_tree_response_logprobs, prefix_tree_response_values
from skylift.worker.profiler import ProfilerSettings, StepProfiler, profiled
from skylift.worker.routing_replay import RoutingTally, replayed
from skylift.worker.sequence_parallel import SequenceSplit, pool_rows
from skylift.worker.sharding import full_tensor, hybrid_mesh, shard_model
from skylift.worker.ulysses import sequence_parallel_groups
from skylift.worker.vision_inputs import load_vision_language

# loss_fn(new_logprobs [b, R], micro_batch) -> (loss to backpropagate, metrics). A loss function
# with a true `needs_full_logprobs` attribute also finds, when the sampling distribution is
# truncated, the untruncated distribution's logprobs as the micro-batch's "full_logprobs" extra.
LossFn = Callable[[Tensor, SequenceBatch], tuple[Tensor, dict[str, float]]]


@dataclass
class WorkerSettings:
    model_path: str
    trainable: bool = True
    dtype: str = "float32"  # parameters (and so optimizer state); bf16 halves memory on GPU
    # mixed precision: forward and backward matmuls in this dtype (torch.autocast) over `dtype`
    # parameters; None = compute in `dtype`. float32 weights + bfloat16 compute keep small updates
    # that bfloat16 weights would round away
    compute_dtype: str | None = None
    gradient_checkpointing: bool = False
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_target_modules: list[str] | str = "all-linear"
    lora_dropout: float = 0.0
    # FSDP2 sharding: None = when there is more than one rank (one rank gains nothing from
    # fully_shard and pays its gather/scatter copies: slower on CPU), True = always
    fsdp: bool | None = None
    reshard_after_forward: bool = True  # see skylift.worker.sharding.shard_model
    cpu_offload: bool = False
    fsdp_size: int = -1  # hybrid sharding: shard groups of this size (see sharding.hybrid_mesh)
    # Ulysses sequence parallelism: groups of this many consecutive ranks split each sequence
    # (skylift.worker.sequence_parallel); 1 = every rank holds whole sequences
    sequence_parallel_size: int = 1
    seed: int = 42
    num_threads: int | None = None  # torch intra-op threads (CPU); None = torch default
    # "lm": a causal LM scored by response-token logprobs (policy, reference); "value": the same
    # backbone with a scalar head per token (transformers' *ForTokenClassification), a PPO critic
    head: str = "lm"
    # the ranks' rendezvous and every collective between them (FSDP gathers, gradient reductions)
    collective_timeout_s: float = 600.0
    # micro-batches by a token budget instead of a row count (None = `micro_batch_size` rows)
    max_tokens_per_microbatch: int | None = None
    # padding-free: each micro-batch's sequences packed into one row (skylift.worker.micro_batches)
    remove_microbatch_padding: bool = False
    # each micro-batch as one row holding every distinct prefix once (skylift.worker.prefix_tree)
    share_prefixes: bool = False
    profiler: ProfilerSettings | None = None  # torch.profiler traces of chosen steps (worker.profiler)


def load_pretrained(model_path: str, dtype: str = "float32", head: str = "lm") -> torch.nn.Module:
    """A checkpoint's transformers model in `dtype`: a causal LM, an image-text-to-text model, or
    with head "value" the backbone with a new scalar head (transformers initialises it from the
    global seed)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from skylift.models import resolve_model_path

    path = resolve_model_path(model_path)
    torch_dtype = str_to_dtype(dtype, FLOAT_DTYPES)
    if head == "value":
        return AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch_dtype)
    vision = load_vision_language(path, torch_dtype)
    return vision if vision is not None else AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)


class TrainingWorker:
    """One rank of a (possibly sharded) model. Create, then call `setup()` on every rank."""

    #: packed passes score only the tokens `response_mask` marks (0 elsewhere): for losses that
    #: read nothing else (the supervised ones); the RL workers keep every response token's logprob
    targets_only = False

    def __init__(
        self, settings: WorkerSettings, rank: int = 0, world_size: int = 1, init_method: str | None = None
    ) -> None:
        self.settings, self.rank, self.world_size, self.init_method = settings, rank, world_size, init_method
        self.profiler = StepProfiler(settings.profiler, rank) if settings.profiler else None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.device = torch.device("cpu")
        self.global_step = 0
        self.sp_group: Any = None  # this rank's sequence-parallel group (sequence_parallel_size > 1)

    # ---------------------------------------------------------------- set-up
    def setup(self, base: torch.nn.Module | None = None) -> dict[str, Any]:
        """Build the model (and optimizer). `base`: a loaded model to build on instead of loading
        `model_path` (the Tinker server hands each LoRA client a module tree over one resident
        copy of the base weights, `skylift.tinker.training.base_pool`); LoRA, the device move and the
        optimizer then apply to it as to a loaded one."""
        started = time.perf_counter()
        s = self.settings
        if s.head not in ("lm", "value"):
            raise ValueError(f"unknown head {s.head!r}; use 'lm' (policy, reference) or 'value' (critic)")
        if s.sequence_parallel_size < 1 or self.world_size % s.sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size={s.sequence_parallel_size} must divide the {self.world_size} "
                "ranks of the worker group"
            )
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        shard = bool(s.fsdp) if s.fsdp is not None else self.world_size > 1
        if self.world_size > 1 or shard:
            init_method = self.init_method or f"file://{_default_rendezvous_file()}"
            init_training_group(self.rank, self.world_size, init_method, s.collective_timeout_s)
        if s.sequence_parallel_size > 1:
            self.sp_group = sequence_parallel_groups(self.world_size, s.sequence_parallel_size, self.rank)
        self.device = device_for_rank(self.rank)
        torch.manual_seed(s.seed)
        model = base if base is not None else load_pretrained(s.model_path, s.dtype, s.head)
        model.config.use_cache = False
        if s.gradient_checkpointing and s.trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if s.lora_rank > 0:
            model = add_lora(
                model,
                rank=s.lora_rank,
                alpha=s.lora_alpha,
                target_modules=s.lora_target_modules,
                dropout=s.lora_dropout,
                value_head=s.head == "value",
            )
        if not s.trainable:
            model.requires_grad_(False)
            model.eval()
        model.to(self.device)
        if shard and dist.is_initialized():
            mesh = hybrid_mesh(self.world_size, s.fsdp_size, self.device.type)
            shard_model(
                model, reshard_after_forward=s.reshard_after_forward, cpu_offload=s.cpu_offload, mesh=mesh
            )
        self.model = model
        if s.trainable:
            params = [p for p in model.parameters() if p.requires_grad]
            o = s.optimizer
            # The fused kernel (CPU and CUDA) is faster than the per-tensor loop and the multi-tensor
            # (foreach) step, which also needs temporaries the size of all parameters
            # (benchmarks/RESULTS.md). Sharded (DTensor) parameters keep the per-tensor loop.
            fused = {"fused": True} if not shard else {"foreach": False}
            self.optimizer = o.adamw(params, **fused)
            self.scheduler = make_lr_scheduler(self.optimizer, o)
        n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole's
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        return {
            "rank": self.rank,
            "params": n_params,
            "local_params": local,
            "setup_s": time.perf_counter() - started,
        }

    # ---------------------------------------------------------------- forward
    def _response_outputs(
        self,
        model: torch.nn.Module,
        micro: SequenceBatch,
        temperature: Sampling,
        with_full: bool = False,
        split: SequenceSplit | None = None,
    ) -> Tensor:
        """Per response token: logprobs (head "lm") or values (head "value"), `[b, R]`; `[b, R, 2]`
        `with_full` (see `response_logprobs`); from this rank's slice of the sequences with `split`
        (sequence parallelism, inside `split.attention`)."""
        if split is not None:
            with self._autocast():
                if self.settings.head == "value":
                    return split.values(model)
                return split.logprobs(model, temperature, with_full)
        # packed and prefix-shared paths: rows without row_inputs (images, routed experts) only
        text = "target_ids" not in micro.extras and micro.row_inputs is None
        tree = text and self.settings.share_prefixes
        packed = text and self.settings.remove_microbatch_padding and not tree
        with self._autocast():
            if self.settings.head == "value":
                if tree:
                    return prefix_tree_response_values(model, micro)
                return (packed_response_values if packed else response_values)(model, micro)
            if tree:
                return prefix_tree_response_logprobs(model, micro, temperature, with_full)
            if packed:
                return packed_response_logprobs(model, micro, temperature, with_full, self.targets_only)
            return response_logprobs(model, micro, temperature, with_full=with_full)

    def _split(
        self, micro: SequenceBatch, tally: RoutingTally | None = None
    ) -> tuple[SequenceSplit | None, contextlib.AbstractContextManager[Any]]:
        """A micro-batch's split over the sequence-parallel group and the context its forward and
        backward passes run in (a policy's rows' routed experts replayed, counted in `tally`)."""
        if self.sp_group is None:
            lm = self.settings.head == "lm"
            return None, replayed(self._model(), micro, tally) if lm else contextlib.nullcontext()
        split = SequenceSplit(micro, self.sp_group)
        return split, split.attention(self._model())

    def _pooled(self, batch: SequenceBatch) -> tuple[SequenceBatch, slice]:
        """The sequence-parallel group's rows (every rank of the group gets the same) and this
        rank's among them; the batch itself without sequence parallelism."""
        if self.sp_group is None:
            return batch, slice(0, batch.batch_size)
        return pool_rows(batch, self.sp_group)

    def _micro_batches(self, batch: SequenceBatch, micro_batch_size: int) -> list[list[int]]:
        s = self.settings
        packed = s.remove_microbatch_padding or s.share_prefixes  # a budget of real tokens
        return micro_batch_rows(batch, micro_batch_size, s.max_tokens_per_microbatch, packed=packed)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision (`compute_dtype`) for a forward pass and the backward pass it records."""
        s = self.settings
        if s.compute_dtype is None:
            return contextlib.nullcontext()
        compute_dtype = str_to_dtype(s.compute_dtype, FLOAT_DTYPES)
        if compute_dtype == str_to_dtype(s.dtype, FLOAT_DTYPES):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=compute_dtype)

    def compute_logprobs(
        self, batch: SequenceBatch, micro_batch_size: int, temperature: Sampling = 1.0
    ) -> Tensor:
        """Response-token logprobs `[B, R]` (zeros at padding) of a causal LM (head "lm"), under
        the sampling temperature or the whole `TokenDistribution` the tokens were sampled from."""
        self._require_head("lm", "compute_logprobs")
        return self._per_token_outputs(batch, micro_batch_size, temperature)

    def compute_values(self, batch: SequenceBatch, micro_batch_size: int) -> Tensor:
        """A value model's (head "value") estimate per response token `[B, R]` (zeros at padding)."""
        self._require_head("value", "compute_values")
        return self._per_token_outputs(batch, micro_batch_size, 1.0)

    def _require_head(self, head: str, operation: str) -> None:
        if self.settings.head != head:
            raise RuntimeError(
                f"{operation} needs a worker with head {head!r}, this one has {self.settings.head!r}"
            )

    @torch.no_grad()
    def _per_token_outputs(
        self, batch: SequenceBatch, micro_batch_size: int, temperature: Sampling
    ) -> Tensor:
        model = self._model()
        was_training = model.training
        model.eval()
        out: Tensor | None = None
        width = batch.response_len
        batch, own = self._pooled(batch)
        for rows in self._micro_batches(batch, micro_batch_size):
            micro = batch.select(rows).to(self.device)
            split, context = self._split(micro)
            with context:
                logp = self._response_outputs(model, micro, temperature, split=split)
            if out is None:  # [B, R] or, with [B, R, K] target_ids, [B, R, K]
                out = torch.zeros(batch.batch_size, batch.response_len, *logp.shape[2:])
            mask = micro.response_mask.cpu().reshape(*micro.response_mask.shape, *([1] * (logp.dim() - 2)))
            out[rows, : micro.response_len] = logp.float().cpu() * mask
        model.train(was_training)
        assert out is not None
        return out[own, :width]

    # ---------------------------------------------------------------- training
    def train_mini_batch(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        temperature: Sampling = 1.0,
    ) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over micro-batches, clip, and take one optimizer step.

        `loss_fn` must already be normalised for the whole mini-batch (across all ranks), so the
        accumulated gradient equals the gradient of one pass over the whole mini-batch.
        """
        with profiled(self.profiler, self.global_step, self.device):
            self.zero_grad()
            metrics = self.accumulate_gradients(batch, loss_fn, micro_batch_size, temperature)
            metrics.update(self.optimizer_step())
        return metrics

    def zero_grad(self) -> None:
        self._require_trainable()
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def _require_trainable(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("this worker is not trainable (reference model)")

    def accumulate_gradients(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        micro_batch_size: int,
        temperature: Sampling = 1.0,
    ) -> dict[str, float]:
        """Backpropagate `loss_fn` over micro-batches of `batch`, adding to the current gradients
        (no optimizer step). Returns the loss function's metrics averaged over micro-batches."""
        model = self._model()
        self._require_trainable()
        model.train()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        with_full = getattr(loss_fn, "needs_full_logprobs", False) and as_distribution(temperature).truncates
        batch, _ = self._pooled(batch)  # sequence parallelism: every rank of a group, the same rows
        tally = RoutingTally()  # routing replay: how often it overrode the trainer's own routers
        for rows in self._micro_batches(batch, micro_batch_size):
            micro = batch.select(rows).to(self.device)
            split, context = self._split(micro, tally)
            with context:  # backward too: checkpointed layers recompute their forward in it
                logp = self._response_outputs(model, micro, temperature, with_full, split)
                if with_full:
                    micro = micro.with_extras(full_logprobs=logp[..., 1])
                    logp = logp[..., 0]
                loss, metrics = loss_fn(logp, micro)
                if self.world_size > 1:
                    # FSDP averages gradients over ranks; the ranks of a sequence-parallel group
                    # each hold their tokens' share of their pooled rows' gradient
                    loss = loss * self.world_size
                loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
                counts[k] = counts.get(k, 0) + 1
        return {k: sums[k] / counts[k] for k in sums} | tally.metrics()

    def optimizer_step(self, max_grad_norm: float | None = None) -> dict[str, float]:
        """Clip the accumulated gradients, step the optimizer and its schedule, then clear them.

        `max_grad_norm` overrides the settings' clip norm for this step; a norm <= 0 means no
        clipping. The optimizer uses its param groups' current hyper-parameters (a caller may set
        them before the step: `optimizer.param_groups` is PyTorch's public interface for that).
        """
        model = self._model()
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("this worker is not trainable (reference model)")
        max_norm = self.settings.optimizer.clip_norm(max_grad_norm)
        params = [p for p in model.parameters() if p.requires_grad]
        grad_norm_value = float(full_tensor(clipped_step(self.optimizer, params, max_norm)))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return {"grad_norm": grad_norm_value, "lr": self.optimizer.param_groups[0]["lr"]}

    # ---------------------------------------------------------------- weights
    def iter_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) Hugging Face-named tensors; a collective: every rank must iterate.

        LoRA adapters are merged into the base weights on the fly. Non-zero ranks get the
        same tensors (they may ignore them).
        """
        model = self._model()
        if self.settings.lora_rank > 0:
            yield from merged_lora_weights(model)
            return
        for name, tensor in model.state_dict().items():
            yield name, full_tensor(tensor)

    def lora_adapter(self) -> tuple[list[tuple[str, Tensor]], dict[str, Any]]:
        """The policy's LoRA adapter as PEFT saves it: (tensor name, full tensor) pairs of
        `adapter_model.safetensors` and the `adapter_config.json` dict. A collective."""
        if self.settings.lora_rank <= 0:
            raise RuntimeError("lora_adapter: this worker trains no LoRA adapter (lora_rank is 0)")
        from peft import get_peft_model_state_dict

        model = self._model()
        # the adapter only: PEFT's default also saves an adapted unembedding's whole base matrix
        # (vocab x hidden), which nothing here resizes
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        tensors = [(k, full_tensor(v)) for k, v in state.items()]
        return tensors, model.peft_config["default"].to_dict()  # type: ignore[union-attr,index,operator]

    # ---------------------------------------------------------------- checkpoints
    def _dcp_state(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...} state dicts in the form torch.distributed.checkpoint uses."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self._model(), optimizers)
        state: dict[str, Any] = {"model": model_sd}
        if optimizers:
            state["optimizer"] = optim_sd
        return state

    def save_checkpoint(self, directory: str) -> None:
        """Sharded model + optimizer state (torch.distributed.checkpoint); every rank calls."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=directory)
        if self.rank == 0 and self.scheduler is not None:
            torch.save(
                {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step},
                os.path.join(directory, "worker_extra.pt"),
            )

    def load_checkpoint(self, directory: str, trainable_only: bool = False) -> None:
        """Load a checkpoint of `save_checkpoint` (resharded to this group's ranks); a checkpoint of
        another model is refused first with the weights that differ (`checkpoint_match`).
        `trainable_only`: load the trainable weights (and optimizer) only, never writing the frozen
        ones (a LoRA client's base weights, shared with other clients)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._dcp_state()
        if trainable_only:
            trained = {n for n, p in self._model().named_parameters() if p.requires_grad}
            state["model"] = {k: v for k, v in state["model"].items() if k in trained}
        expected = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, Tensor)}
        problem = model_mismatch(checkpoint_shapes(directory), expected, self.settings.model_path)
        if problem:
            raise ValueError(f"{directory}: {problem}")
        dcp.load(state, checkpoint_id=directory)
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(
            self._model(),
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}),
            options=StateDictOptions(strict=not trainable_only),
        )
        extra = os.path.join(directory, "worker_extra.pt")
        if self.scheduler is not None and os.path.exists(extra):
            data = torch.load(extra, weights_only=False)
            self.scheduler.load_state_dict(data["scheduler"])
            self.global_step = int(data["global_step"])

    def export_hf(self, directory: str) -> str | None:
        """Write a Hugging Face model directory (rank 0) loadable by transformers and vLLM."""
        from transformers import AutoTokenizer

        from skylift.models import resolve_model_path

        weights = dict(self.iter_full_weights())  # collective
        if self.rank != 0:
            return None
        model = self._model()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        Path(directory).mkdir(parents=True, exist_ok=True)
        base.save_pretrained(
            directory, state_dict={k: v.contiguous() for k, v in weights.items()}, safe_serialization=True
        )
        src = resolve_model_path(self.settings.model_path)
        AutoTokenizer.from_pretrained(src).save_pretrained(directory)
        return directory

    # ---------------------------------------------------------------- misc
    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("worker not set up: call setup() first")
        return self.model

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _default_rendezvous_file() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"skylift-rdzv-{os.getpid()}")
