"""The LoRA half of the receiver vLLM mixes into every worker (see `skylift.weight_sync.lora`).

`LoraReceiverExtension.skylift_receive_lora_adapter` receives an adapter's one bucket over the
weight-update group that `WeightSyncWorkerExtension` joined (every worker takes part in the
broadcast); worker 0 writes it to the directory the engine chose on its own host, in PEFT's
layout, and the engine then loads it from there with vLLM's `add_lora`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from skylift.weight_sync.buckets import unpack_bucket
from skylift.weight_sync.lora import write_adapter_dir
from skylift.weight_sync.process_group import receive_bucket

logger = logging.getLogger(__name__)


class LoraReceiverExtension:
    """A mixin for vLLM's Worker beside `WeightSyncWorkerExtension` (uses its group)."""

    def skylift_receive_lora_adapter(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        directory: str,
        peft_config: dict[str, Any],
    ) -> str | None:
        """Receive the adapter from rank 0; worker 0 writes it to `directory` and returns it."""
        start = time.perf_counter()
        bucket, buffers = receive_bucket(getattr(self, "_skylift_group", None), names, dtypes, shapes)
        if int(getattr(self, "rank", 0)) != 0:
            return None
        write_adapter_dir(directory, unpack_bucket(bucket, buffers), peft_config)
        logger.debug(
            "LoRA adapter of %d tensors received in %.1f ms", len(names), 1e3 * (time.perf_counter() - start)
        )
        return directory
