"""The class vLLM mixes into every worker: skylift's weight receiver, plus skylift's vLLM fixes.

``worker_extension_cls="skylift.inference.vllm_worker.WeightSyncWorkerExtension"`` (what
`skylift.inference.engine_args` and the server set). The receivers themselves live with the rest
of the weight-sync protocol (`skylift.weight_sync.receiver` for full weights,
`skylift.weight_sync.lora_receiver` for LoRA adapters); importing this module (vLLM does, in
every worker) also installs `skylift.inference.vllm_fixes`.
"""

from __future__ import annotations

import logging

from skylift.inference import vllm_fixes
from skylift.weight_sync.lora_receiver import LoraReceiverExtension
from skylift.weight_sync.receiver import WeightSyncWorkerExtension as _WeightReceiver

__all__ = ["WeightSyncWorkerExtension"]


class WeightSyncWorkerExtension(_WeightReceiver, LoraReceiverExtension):
    """Full-weight and LoRA-adapter receiving, on one weight-update group per worker."""


if not vllm_fixes.install():
    logging.getLogger(__name__).warning(
        "vLLM's model runner changed: skylift's fix for seeded requests on CPU is not installed"
    )
