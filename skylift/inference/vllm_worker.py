"""The class vLLM mixes into every worker: skylift's weight receiver, plus skylift's vLLM fixes.

``worker_extension_cls="skylift.inference.vllm_worker.WeightSyncWorkerExtension"`` (what
`skylift.inference.engine_args` and the server set). The receivers themselves live with the rest
of the weight-sync protocol (`skylift.weight_sync.receiver` for full weights,
`skylift.weight_sync.lora_receiver` for LoRA adapters, `skylift.weight_sync.delta_receiver` for
checkpoint-delta sync); importing this module (vLLM does, in
every worker) also installs `skylift.inference.vllm_fixes`.
"""

from __future__ import annotations

import logging

from skylift.inference import vllm_fixes
from skylift.weight_sync.delta_receiver import DeltaReceiverExtension
from skylift.weight_sync.lora_receiver import LoraReceiverExtension

__all__ = ["WeightSyncWorkerExtension"]


class WeightSyncWorkerExtension(DeltaReceiverExtension, LoraReceiverExtension):
    """Full-weight and LoRA-adapter receiving, on one weight-update group per worker, and loading
    from a checkpoint-delta store (`weight_sync.delta_receiver`, which extends the full-weight receiver)."""


if not vllm_fixes.install():
    logging.getLogger(__name__).warning(
        "vLLM's model runner changed: skylift's fix for seeded requests on CPU is not installed"
    )
