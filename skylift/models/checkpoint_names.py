"""The tensors a trainer holds in memory, under the names and layouts of the model's checkpoint.

An inference engine loads a model from its checkpoint, so a weight sync must send what the
checkpoint holds. transformers 5 keeps some layers in memory in another form than on disk: a
mixture-of-experts layer's experts are fused into 3-d `mlp.experts.gate_up_proj` / `down_proj`
tensors while the checkpoint holds one matrix per expert (`mlp.experts.N.gate_proj.weight`, or
Mixtral's `block_sparse_moe.experts.N.w1.weight`), and a vision-language model's text layers sit
under `model.language_model.` in memory but `model.` on disk. transformers records how it converted
a checkpoint at load (`model._weight_conversions`, or its registered mapping for the model type) and
reverts that conversion when it saves (`revert_weight_conversion`). That inverse is the one rule
used here, for every model family: no table per model. Each name it produces is checked against
the checkpoint's own tensor names where the checkpoint is a local directory; a name that does not
map stops the sync with one line naming the parameter and the model class (`UnmappedWeightError`).

The conversion runs one layer at a time (the tensors whose names share the prefix up to the first
number, `model.layers.3`), so a sync streams as before, holding one layer's tensors at most.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

SHOWN = 3  # checkpoint names quoted in an error
_LAYER_PREFIX = re.compile(r"^(.*?\.\d+)\.")


class UnmappedWeightError(ValueError):
    """A tensor of the trainer's model has no name in its checkpoint (one line: the parameter, the
    model class, and what it became)."""


def checkpoint_tensor_names(model_dir: str | os.PathLike[str]) -> frozenset[str] | None:
    """The tensor names of the safetensors checkpoint in `model_dir` (read from the file headers
    only), or None when `model_dir` is not a local directory holding `*.safetensors` files."""
    path = Path(model_dir)
    files = sorted(glob.glob(str(path / "*.safetensors"))) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, "pt") as handle:
            names.update(handle.keys())
    return frozenset(names)


def _conversions(model: Any) -> list[Any]:
    """The transformers conversions applied when `model` was loaded (or, for a model built from
    its config, those registered for its type); [] when there are none or transformers < 5."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4 keeps the checkpoint's layout in memory
        return []
    recorded = getattr(model, "_weight_conversions", None)
    if recorded is not None:
        return list(recorded)
    registered = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in registered if not isinstance(c, PrefixChange)]


def layer_key(name: str) -> str:
    """The group a tensor is converted with: its name up to the first number (`model.layers.3`), or
    the whole name for a tensor outside numbered blocks (`lm_head.weight`)."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else name


class CheckpointNames:
    """Turns a model's in-memory (name, tensor) pairs into the checkpoint's (name, tensor) pairs.

    `model`: the transformers model (a PEFT wrapper's base model, an FSDP2-sharded model: its class
    and conversions are the same). `checkpoint_names`: the checkpoint's tensor names to check
    against (`checkpoint_tensor_names`); None checks nothing. `source`: where the checkpoint is, for
    messages.
    """

    def __init__(self, model: Any, checkpoint_names: frozenset[str] | None = None, source: str = "") -> None:
        self.model = model
        self.model_class = type(model).__name__.removeprefix("FSDP")
        self.checkpoint_names = checkpoint_names
        self.source = source
        self.conversions = _conversions(model)
        self.tied = set(getattr(model, "all_tied_weights_keys", None) or {})

    @property
    def identity(self) -> bool:
        """True when the model holds its tensors as the checkpoint does (nothing to convert)."""
        return not self.conversions

    def convert(self, tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The checkpoint's (name, tensor) pairs for the in-memory `tensors`, streamed layer by layer
        (tensors of one layer must come together, as a state dict yields them)."""
        group: list[tuple[str, Tensor]] = []
        key = None
        for name, tensor in tensors:
            if group and layer_key(name) != key:
                yield from self._convert_group(group)
                group = []
            key = layer_key(name)
            group.append((name, tensor))
        if group:
            yield from self._convert_group(group)

    def _convert_group(self, group: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        if self.identity:
            converted = dict(group)
            origin = {name: name for name, _ in group}
        else:
            converted = self._revert(group)
            origin = self._origins(group, converted)
        for name, tensor in converted.items():
            self._check(name, origin.get(name, name))
            yield name, tensor

    def _revert(self, group: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        try:
            return dict(revert_weight_conversion(self.model, dict(group)))
        except Exception as exc:  # transformers' converters raise anything from shape checks
            names = ", ".join(name for name, _ in group[:SHOWN])
            raise UnmappedWeightError(
                f"weight sync: the parameters {names} of {self.model_class} do not convert to its "
                f"checkpoint's layout: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None

    @staticmethod
    def _origins(group: list[tuple[str, Tensor]], converted: dict[str, Tensor]) -> dict[str, str]:
        """Each converted name -> the in-memory name it came from (by shared leading components),
        for messages only."""
        origins: dict[str, str] = {}
        for name in converted:
            best = max(group, key=lambda item: _shared_prefix(item[0], name))
            origins[name] = best[0]
        return origins

    def _check(self, name: str, origin: str) -> None:
        names = self.checkpoint_names
        if names is None or name in names or origin in self.tied or name in self.tied:
            return
        near = sorted(n for n in names if layer_key(n) == layer_key(name))[:SHOWN] or sorted(names)[:SHOWN]
        became = "" if name == origin else f" (converted to {name})"
        where = f" at {self.source}" if self.source else ""
        raise UnmappedWeightError(
            f"weight sync: the parameter {origin} of {self.model_class}{became} has no tensor of that "
            f"name in the model's checkpoint{where} (it holds e.g. {', '.join(near)})"
        )


def _shared_prefix(a: str, b: str) -> int:
    count = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        count += 1
    return count


def checkpoint_names_for(model: Any, model_path: str) -> CheckpointNames:
    """The `CheckpointNames` of `model` loaded from `model_path` (a registry name, a local directory
    or a Hub id), checked against the checkpoint's names when it is a local directory."""
    from skylift.models.registry import resolve_model_path

    resolved = resolve_model_path(model_path)
    return CheckpointNames(model, checkpoint_tensor_names(resolved), source=resolved)


__all__ = [
    "CheckpointNames",
    "UnmappedWeightError",
    "checkpoint_names_for",
    "checkpoint_tensor_names",
    "layer_key",
]
