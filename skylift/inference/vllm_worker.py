"""The class vLLM mixes into every worker: skylift's weight receiver, plus skylift's vLLM fixes.

``worker_extension_cls="skylift.inference.vllm_worker.WeightSyncWorkerExtension"`` (what
`skylift.inference.engine_args` and the server set). The receivers themselves live with the rest
of the weight-sync protocol (`skylift.weight_sync.broadcast.receiver` for full weights,
`skylift.weight_sync.lora.receiver` for LoRA adapters, `skylift.weight_sync.delta.receiver` for
checkpoint-delta sync); importing this module (vLLM does, in
every worker) also installs `skylift.inference.vllm_patches.cpu_seed_rewind`,
`cpu_lora_no_adapter`, `prompt_logprobs_lora_rows`, `cpu_moe_reload` and `cpu_routed_experts` (a vLLM they were not written for fails the
worker's start-up, naming the patch).
"""

from __future__ import annotations

from skylift.inference.vllm_patches import (
    cpu_lora_no_adapter,
    cpu_moe_reload,
    cpu_routed_experts,
    cpu_seed_rewind,
    prompt_logprobs_lora_rows,
)
from skylift.weight_sync.delta.receiver import DeltaReceiverExtension
from skylift.weight_sync.lora.receiver import LoraReceiverExtension
from skylift.weight_sync.worker_side import WorkerReceivers

__all__ = ["WeightSyncWorkerExtension"]


class WeightSyncWorkerExtension(DeltaReceiverExtension, LoraReceiverExtension, WorkerReceivers):
    """Full-weight and LoRA-adapter receiving, on one weight-update group per worker, and loading
    from a checkpoint-delta store (`weight_sync.delta.receiver`, which extends the full-weight
    receiver); every later transport's worker half through one method (`weight_sync.worker_side`:
    its receiver object, named in `weight_sync.factory.WORKER_RECEIVERS`)."""


cpu_seed_rewind.install()
cpu_lora_no_adapter.install()
prompt_logprobs_lora_rows.install()
cpu_moe_reload.install()
cpu_routed_experts.install()
