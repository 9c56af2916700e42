"""Staging the parts of vLLM's fused modules when a sender sends one tensor per update.

vLLM loads several Hugging Face tensors into one module (`q_proj`, `k_proj`, `v_proj` weights and
biases -> `qkv_proj`; `gate_proj` + `up_proj` -> `gate_up_proj`) and rebuilds that module from the
tensors of ONE reload: parts it did not receive come back uninitialised. skylift's own sender keeps
a module's parts in one bucket; a per-tensor sender (`WeightUpdateGroupSpec.protocol`) sends one
parameter per request. `FusedStager` sits between the receive and the reload: tensors of a module
that is not complete yet are held back, and the module is handed to the reload in one piece once
its last part arrives.

A module is never loaded in part. When a tensor of another layer arrives while a module of an
earlier one is still incomplete (the sender moved past it), or when the group is destroyed with
parts staged, the stager reports what is missing (`IncompleteModuleError`) and drops the parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from skylift.weight_sync.buckets import load_unit

NamedTensor = tuple[str, torch.Tensor]


class IncompleteModuleError(RuntimeError):
    """A fused module's parts did not all arrive; nothing of it was loaded."""


@dataclass(frozen=True)
class LoadUnits:
    """Which Hugging Face tensors vLLM loads together, derived from a vLLM model.

    `packed`: vLLM's `packed_modules_mapping` (fused leaf -> Hugging Face leaves, e.g.
    ``qkv_proj -> [q_proj, k_proj, v_proj]``); `params`: vLLM module -> its parameter leaves
    (``model.layers.0.self_attn.qkv_proj -> [weight, bias]``).
    """

    packed: dict[str, list[str]]
    params: dict[str, list[str]]

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> LoadUnits:
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        params: dict[str, list[str]] = {}
        for name, _ in model.named_parameters():
            module, _, leaf = name.rpartition(".")
            params.setdefault(module, []).append(leaf)
        return cls(packed=packed, params=params)

    def unit_of(self, name: str) -> str:
        """The vLLM module a Hugging Face tensor loads into
        (``model.layers.0.self_attn.k_proj.bias`` -> ``model.layers.0.self_attn.qkv_proj``)."""
        module = name.rpartition(".")[0]
        prefix, _, leaf = module.rpartition(".")
        for fused, parts in self.packed.items():
            if leaf in parts:
                return f"{prefix}.{fused}" if prefix else fused
        return module

    def expected(self, unit: str) -> list[str] | None:
        """Every Hugging Face tensor name that loads into `unit` (None for a module vLLM lacks)."""
        leaves = self.params.get(unit)
        if leaves is None:
            return None
        prefix, _, leaf = unit.rpartition(".")
        parts = self.packed.get(leaf)
        if parts is None:
            return [f"{unit}.{p}" for p in leaves]
        base = f"{prefix}." if prefix else ""
        return [f"{base}{part}.{p}" for part in parts for p in leaves]

    def partial_units(self, names: Iterable[str]) -> dict[str, tuple[list[str], list[str]]]:
        """Modules that `names` cover only in part: unit -> (names given, names missing)."""
        given: dict[str, list[str]] = {}
        for name in names:
            given.setdefault(self.unit_of(name), []).append(name)
        out = {}
        for unit, got in given.items():
            want = self.expected(unit)
            if want is not None and len(got) < len(want):
                out[unit] = (sorted(got), sorted(set(want) - set(got)))
        return out


@dataclass
class FusedStager:
    """Holds the parts of incomplete modules until they are complete (see the module docstring)."""

    units: LoadUnits
    _staged: dict[str, list[NamedTensor]] = field(default_factory=dict)

    def add(self, weights: Sequence[NamedTensor]) -> list[NamedTensor]:
        """Take received tensors; return those that can be loaded now (complete modules, in
        arrival order). Raises `IncompleteModuleError` when a staged module of an earlier layer
        is still incomplete: the staged parts and `weights` are dropped, nothing is loaded."""
        layers = {load_unit(name) for name, _ in weights}
        behind = {u: parts for u, parts in self._staged.items() if load_unit(u) not in layers}
        if behind:
            report = self._describe(behind)
            self._staged.clear()
            moved_to = sorted(layers)[0]
            raise IncompleteModuleError(
                f"the sender moved on to {moved_to} with {report}; nothing of "
                f"{'that module' if len(behind) == 1 else 'those modules'} was loaded "
                f"(a partial load would leave the missing parts uninitialised), nor of {moved_to}"
            )
        ready: list[NamedTensor] = []
        for name, tensor in weights:
            unit = self.units.unit_of(name)
            want = self.units.expected(unit)
            if want is None or len(want) == 1:
                ready.append((name, tensor))
                continue
            parts = self._staged.setdefault(unit, [])
            if any(n == name for n, _ in parts):
                self._staged.pop(unit)
                raise IncompleteModuleError(f"{name} arrived twice for {unit} before it was complete")
            parts.append((name, tensor))
            if len(parts) == len(want):
                ready.extend(self._staged.pop(unit))
        return ready

    def pending(self) -> str | None:
        """What is staged and incomplete, as a sentence; None when nothing is."""
        return self._describe(self._staged) if self._staged else None

    def clear(self) -> None:
        self._staged.clear()

    def _describe(self, staged: dict[str, list[NamedTensor]]) -> str:
        pieces = []
        for unit, parts in staged.items():
            got = sorted(n for n, _ in parts)
            missing = sorted(set(self.units.expected(unit) or []) - set(got))
            pieces.append(f"{unit} incomplete (missing {missing}; received {got})")
        return "; ".join(pieces)
