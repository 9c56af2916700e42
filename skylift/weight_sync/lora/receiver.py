"""The LoRA half of the receiver vLLM mixes into every worker (see `skylift.weight_sync.lora.adapter`).

`LoraReceiverExtension.skylift_receive_lora_adapter` receives an adapter's one bucket over the
weight-update group that `WeightSyncWorkerExtension` joined (every worker takes part in the
broadcast) and installs it in the worker's LoRA manager straight from the received tensors
(`skylift.weight_sync.lora.install`): no file, one engine round trip. The versions it supersedes
leave the worker's adapter cache in the same call.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from skylift.weight_sync.buckets import unpack_bucket
from skylift.weight_sync.lora.install import (
    LoraInstallError,
    build_lora_model,
    install_lora_model,
    retire_adapters,
)
from skylift.weight_sync.process_group import receive_bucket

logger = logging.getLogger(__name__)


class LoraReceiverExtension:
    """A mixin for vLLM's Worker beside `WeightSyncWorkerExtension` (uses its group)."""

    def skylift_receive_lora_adapter(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        lora_int_id: int,
        peft_config: dict[str, Any],
        retire_ids: list[int],
    ) -> dict[str, float]:
        """Remove the adapters `retire_ids`, receive the new one from rank 0 and install it as
        `lora_int_id` (added to the cache and activated). Returns the seconds of each part.
        `lora_int_id` 0: receive the bucket and drop it (the engine refused the adapter; the sender
        is broadcasting regardless)."""
        start = time.perf_counter()
        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        if manager is not None and lora_int_id:  # first: the engine forgets them whatever happens next
            retire_adapters(manager, retire_ids)
        bucket, buffers = receive_bucket(getattr(self, "_skylift_group", None), names, dtypes, shapes)
        received = time.perf_counter()
        if not lora_int_id:
            return {"receive_s": received - start}
        if manager is None:
            raise LoraInstallError("this engine was started without LoRA (enable_lora): no LoRA manager")
        lora = build_lora_model(manager, lora_int_id, dict(unpack_bucket(bucket, buffers)), peft_config)
        built = time.perf_counter()
        timings = {
            "receive_s": received - start,
            "build_s": built - received,
            **install_lora_model(manager, lora),
        }
        logger.debug(
            "LoRA adapter %d of %d tensors installed in %.1f ms (%s)",
            lora_int_id,
            len(names),
            1e3 * (time.perf_counter() - start),
            ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in timings.items()),
        )
        return timings
