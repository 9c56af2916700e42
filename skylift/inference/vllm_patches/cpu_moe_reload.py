"""Patch: on CPU, a weight update of a mixture-of-experts layer repacks the experts' new weights.

On CPU, vLLM 0.32 pads each fused-MoE layer's expert weights and prepacks them into its grouped-gemm
layout when the model first loads (`CPUExperts.process_weights_after_loading`, called from
`UnquantizedFusedMoEMethod._setup_kernel` on its first call only). A weight update (the layerwise
`reload_weights` every full-weight sync uses) runs `_setup_kernel` again, which copies the new,
unpacked weights into the packed storage and skips the prepack: the engine's experts become
scrambled values (trainer and engine logprobs of a tiny Qwen3-MoE then differ by ~0.35 after one
sync). On CPU, `install` repacks after an update: the reloaded layer's new weights go through the
same padding and prepack as at load, and vLLM's reload then copies them into the packed storage
the kernel reads. Other devices are untouched.

Upstream: the `is_weight_update` branch of `_setup_kernel` (vLLM 0.32) assumes a kernel whose
runtime layout `convert_to_unquantized_kernel_format` produces; CPU's prepack lives in the
experts' own `process_weights_after_loading`. Removable when that branch also runs it.
"""

from __future__ import annotations

import functools
from typing import Any

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "cpu_moe_reload"
WRITTEN_FOR = "==0.32.*"


def install() -> None:
    """Patch vLLM's unquantized fused-MoE method (idempotent); `VllmPatchVersionError` on a vLLM it
    does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as module

    method = getattr(module, "UnquantizedFusedMoEMethod", None)
    if method is None or not hasattr(method, "_setup_kernel"):
        raise missing_target(NAME, "UnquantizedFusedMoEMethod._setup_kernel")
    if getattr(method, "_skylift_cpu_moe_reload", False):
        return
    setup = method._setup_kernel

    @functools.wraps(setup)
    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        updating = getattr(self, "moe_kernel", None) is not None
        setup(self, layer, w13, w2)
        if updating and layer.w13_weight.device.type == "cpu":
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = _setup_kernel
    method._skylift_cpu_moe_reload = True
