"""Does a sharded checkpoint (torch.distributed.checkpoint) hold this model's weights?

Resume and `skylift eval --checkpoint` load a checkpoint into a model built from the run's
configuration (`trainer.policy.model.path`). A checkpoint of another model would fail inside
torch's loader with a message about storage keys; this check reads only the checkpoint's
metadata (the names and full shapes of its tensors) and says which weights differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

MODEL_PREFIX = "model."  # the model's entries in the checkpoint's flattened state dict
SHOWN = 3  # names quoted per kind of difference


def checkpoint_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The model tensors of the checkpoint at `directory`: name -> full shape. Raises
    FileNotFoundError when the directory holds no torch.distributed.checkpoint metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(directory)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no sharded checkpoint (no .metadata file)")
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key.removeprefix(MODEL_PREFIX): tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)
    }


def model_mismatch(
    saved: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], model: str
) -> str | None:
    """None when the checkpoint (`saved`) holds every tensor of the model (`expected`) with its
    shape, else a message naming the missing, unexpected and differently shaped weights (`model`:
    the config's model)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(
        f"{name} {tuple(saved[name])} (the model's: {tuple(expected[name])})"
        for name in set(saved) & set(expected)
        if tuple(saved[name]) != tuple(expected[name])
    )
    if not (missing or shapes):  # extra tensors alone: torch's loader skips them, as it always did
        return None
    parts = []
    for label, names in (
        ("missing from the checkpoint", missing),
        ("not in the model", unexpected),
        ("shaped differently", shapes),
    ):
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{len(names)} {label}: {', '.join(names[:SHOWN])}{more}")
    return (
        f"the checkpoint does not hold the weights of the configured model {model} "
        f"(trainer.policy.model.path; LoRA settings must match too): {'; '.join(parts)}"
    )
