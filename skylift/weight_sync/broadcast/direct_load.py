"""Loading received weights straight into a vLLM CPU model's modules, without vLLM's generic reload.

vLLM's in-place `reload_weights` (its layerwise reload) first puts every module of the model on
the meta device; then, for each module whose tensors have all arrived, it allocates fresh memory
for the module's checkpoint-format parameters, runs the weight loaders into it (a copy of every
byte, into pages touched for the first time), processes the module (on CPU: packs a linear weight
into oneDNN's layout, a second copy) and copies the result into the module's original tensors.

`DirectLoader` does the same for the modules it knows, minus the detour: the received tensors of
an unquantized, unsharded linear layer are its weight as they are (the parts of a fused module,
q/k/v or gate/up, received side by side, are one view of the receive buffer: no copy; otherwise
they are copied once into reused scratch memory), a vocabulary embedding's or an RMSNorm's are
copied once into its parameter, and the module's own `process_weights_after_loading` packs it
exactly as vLLM's reload does; then the module's original parameters are put back (vLLM's reload
keeps them too). Same values into the same packing: the engine ends up with the weights vLLM's
reload gives it, to the bit (tests/integration/test_weight_sync_local.py).

Only what was checked against vLLM 0.32's own loaders takes this path: the architectures of
`ARCHITECTURES`, on CPU, with one tensor- and pipeline-parallel rank, no quantization, no LoRA, no
tied parameters. `DirectLoader.for_model` is None otherwise, and `plan` is None for a bucket with
any tensor it does not map (a name, shape or module it does not know): the caller then loads with
vLLM's reload.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from skylift.weight_sync.broadcast.fused_staging import LoadUnits
from skylift.weight_sync.buckets import BufferArena, NamedTensor, Piece
from skylift.weight_sync.protocol import WeightBucket

#: vLLM model classes whose `load_weights` maps Hugging Face tensors to modules as `plan` does
#: (names as they are, q/k/v -> qkv_proj and gate/up -> gate_up_proj in that order, nothing else
#: transformed); read in vLLM 0.32's llama.py and qwen2.py.
ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})

Kind = Literal["linear", "embedding", "norm"]


@dataclass(frozen=True)
class ModuleLoad:
    """How one vLLM module is loaded from the Hugging Face tensors of a bucket."""

    module: torch.nn.Module
    kind: Kind
    #: per parameter of the module ("weight", "bias"), the Hugging Face names of its parts in order
    parts: dict[str, list[str]]


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _kind(module: torch.nn.Module) -> Kind | None:
    """The kind of a module this loader handles, or None."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    linear = (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    if type(module) in linear:
        if type(getattr(module, "quant_method", None)) is UnquantizedLinearMethod and module.tp_size == 1:
            return "linear"
        return None
    if type(module) in (VocabParallelEmbedding, ParallelLMHead):
        method = getattr(module, "quant_method", None)
        if type(method) is UnquantizedEmbeddingMethod and module.tp_size == 1:
            return "embedding"
        return None
    if type(module) is RMSNorm and getattr(module, "has_weight", True):
        return "norm"
    return None


class DirectLoader:
    """Loads buckets of Hugging Face tensors into a vLLM model's modules (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, units: LoadUnits) -> None:
        self.model = model
        self.units = units
        self._scratch = BufferArena(torch.device("cpu"))
        self._modules: dict[str, torch.nn.Module | None] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module, vllm_config: Any, units: LoadUnits) -> DirectLoader | None:
        """A loader for `model`, or None when it is not one this loader was checked against."""
        parallel = vllm_config.parallel_config
        if (
            type(model).__name__ not in ARCHITECTURES
            or not _is_cpu()
            or vllm_config.model_config.quantization is not None
            or getattr(vllm_config, "lora_config", None) is not None
            or parallel.tensor_parallel_size != 1
            or parallel.pipeline_parallel_size != 1
        ):
            return None
        seen: set[int] = set()
        for _, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:  # a tied parameter (e.g. lm_head = embed_tokens): vLLM's reload
                return None
            seen.add(id(param))
        return cls(model, units)

    def _module(self, unit: str) -> torch.nn.Module | None:
        if unit not in self._modules:
            try:
                module: torch.nn.Module | None = self.model.get_submodule(unit)
            except AttributeError:
                module = None
            self._modules[unit] = module if module is not None and _kind(module) else None
        return self._modules[unit]

    def plan(self, bucket: WeightBucket) -> list[ModuleLoad] | None:
        """How to load every tensor of `bucket`, or None when any of them is not one this loader
        maps exactly (vLLM's reload then loads the bucket)."""
        shapes = {n: tuple(s) for n, s in zip(bucket.names, bucket.shapes, strict=True)}
        by_unit: dict[str, list[str]] = {}
        for name in bucket.names:
            by_unit.setdefault(self.units.unit_of(name), []).append(name)
        loads = []
        for unit, names in by_unit.items():
            module = self._module(unit)
            if module is None:
                return None
            load = self._plan_module(unit, module, set(names), shapes)
            if load is None:
                return None
            loads.append(load)
        return loads

    def _plan_module(
        self, unit: str, module: torch.nn.Module, names: set[str], shapes: Mapping[str, tuple[int, ...]]
    ) -> ModuleLoad | None:
        kind = _kind(module)
        own = {n for n, _ in module.named_parameters(recurse=False)}
        prefix, _, leaf = unit.rpartition(".")
        base = f"{prefix}." if prefix else ""
        if kind == "linear":
            if not own <= {"weight", "bias"} or "weight" not in own:
                return None
            fused = self.units.packed.get(leaf)
            part_names = [f"{base}{p}" for p in fused] if fused else [unit]
            rows = list(module.output_sizes) if fused else [module.output_size_per_partition]
            if len(rows) != len(part_names) or sum(rows) != module.output_size_per_partition:
                return None
            cols = module.input_size_per_partition
            parts = {p: [f"{n}.{p}" for n in part_names] for p in sorted(own)}
            expected = {"weight": [(r, cols) for r in rows], "bias": [(r,) for r in rows]}
        elif kind == "embedding":
            if own != {"weight"} or module.weight.shape != (
                module.num_embeddings_padded,
                module.embedding_dim,
            ):
                return None
            parts = {"weight": [f"{unit}.weight"]}
            expected = {"weight": [(module.org_vocab_size, module.embedding_dim)]}
        elif kind == "norm":
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            weight = module.weight
            if (
                own != {"weight"}
                or getattr(weight, "weight_loader", default_weight_loader) is not default_weight_loader
            ):
                return None
            parts = {"weight": [f"{unit}.weight"]}
            expected = {"weight": [tuple(weight.shape)]}
        else:
            return None
        if names != {n for ns in parts.values() for n in ns}:
            return None
        for param, ns in parts.items():
            if [shapes[n] for n in ns] != expected[param]:
                return None
        return ModuleLoad(module=module, kind=kind, parts=parts)

    def load(self, loads: Sequence[ModuleLoad], tensors: Sequence[NamedTensor]) -> None:
        """Load a bucket's tensors (`tensors`, e.g. views of the receive buffer) as `plan` said."""
        by_name = dict(tensors)
        for load in loads:
            getattr(self, f"_load_{load.kind}")(load, by_name)

    def _fused(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The parts stacked along dim 0 in `dtype`: a view when they lie side by side in one
        buffer already, else a copy into scratch memory (reused; see `BufferArena`)."""
        if all(p.dtype == dtype and p.is_contiguous() for p in parts) and _adjacent(parts):
            first = parts[0]
            shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
            return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        (flat,) = self._scratch.take([(dtype, math.prod(shape))])
        out = flat.view(shape)
        row = 0
        for p in parts:
            out[row : row + p.shape[0]].copy_(p)
            row += p.shape[0]
        return out

    def _load_linear(self, load: ModuleLoad, by_name: Mapping[str, torch.Tensor]) -> None:
        module = load.module
        kernel = {name: getattr(module, name) for name in load.parts}
        dtype = kernel["weight"].dtype  # the model's dtype (on CPU the packed weight is left empty)
        for name, names in load.parts.items():
            staged = self._fused([by_name[n] for n in names], dtype)
            setattr(module, name, torch.nn.Parameter(staged, requires_grad=False))
        module.quant_method.process_weights_after_loading(module)
        _restore_kernel_tensors(module, kernel)

    def _load_embedding(self, load: ModuleLoad, by_name: Mapping[str, torch.Tensor]) -> None:
        module = load.module
        loaded = by_name[load.parts["weight"][0]]
        weight = module.weight
        weight.data[: loaded.shape[0]].copy_(loaded)
        weight.data[loaded.shape[0] :].fill_(0)  # vLLM's padding rows
        kernel = {"weight": weight}
        module.quant_method.process_weights_after_loading(module)
        _restore_kernel_tensors(module, kernel)

    def _load_norm(self, load: ModuleLoad, by_name: Mapping[str, torch.Tensor]) -> None:
        load.module.weight.data.copy_(by_name[load.parts["weight"][0]])


def _adjacent(parts: Sequence[torch.Tensor]) -> bool:
    """True when `parts` are consecutive stretches of one storage, in order."""
    storage = parts[0].untyped_storage().data_ptr()
    end = parts[0].data_ptr()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.data_ptr() != end:
            return False
        end += p.numel() * p.element_size()
    return True


def _restore_kernel_tensors(module: torch.nn.Module, kernel: Mapping[str, torch.nn.Parameter]) -> None:
    """Copy what processing left in the module's parameters into its original ones and put those
    back (what vLLM's reload does after processing: other code may hold the original objects)."""
    for name, original in kernel.items():
        processed = getattr(module, name)
        if processed is not original:
            if processed.shape != original.shape:
                raise RuntimeError(
                    f"{type(module).__name__}.{name}: processing left shape {tuple(processed.shape)}, "
                    f"the module's parameter has {tuple(original.shape)}"
                )
            original.data.copy_(processed)
            delattr(module, name)
            module.register_parameter(name, original)


class LoadingWorker(Protocol):
    """The loading helpers of a vLLM worker (`broadcast.receiver.WeightSyncWorkerExtension`)."""

    def _skylift_direct_loader(self) -> DirectLoader | None: ...

    def _skylift_loading(self) -> AbstractContextManager[None]: ...

    def _skylift_reload(self, weights: Iterable[NamedTensor]) -> None: ...

    def _skylift_reset_runner_caches(self) -> None: ...


def load_direct_then_reload(worker: LoadingWorker, pieces: Iterable[Piece]) -> tuple[int, bool]:
    """Load `pieces` (a bucket's metadata and its tensors, in order) straight into the model's
    modules while `worker`'s direct loader maps them; from the first one it does not, that piece
    and every later one go to ONE vLLM reload that pulls them as it goes. Returns (pieces loaded
    directly, whether the reload ran). A load that was direct only resets the runner's caches, as
    vLLM's reload does. The one path of the broadcast stream, the IPC and the delta receivers;
    each one's own waiting (the stream's receive, the sender's fill counter, the store's reads)
    is in how its `pieces` yields."""
    direct = worker._skylift_direct_loader()
    pending = iter(pieces)
    loaded = 0
    with worker._skylift_loading():
        for bucket, tensors in pending:
            loads = direct.plan(bucket) if direct is not None else None
            if loads is None:  # this piece and the rest: vLLM's reload
                rest = itertools.chain.from_iterable(later for _, later in pending)  # pulled lazily
                worker._skylift_reload(itertools.chain(tensors, rest))
                return loaded, True
            direct.load(loads, tensors)
            loaded += 1
        if loaded:
            worker._skylift_reset_runner_caches()
    return loaded, False
