"""`StreamFence`: a received bucket's buffers are not overwritten while queued GPU work still reads them.

The weight stream's consumer (vLLM's reload, in the worker's main thread) hands a bucket's arena
back as soon as it asked for the next bucket; on a GPU its loads may still be queued on its CUDA
stream, reading the arena, while the receive thread broadcasts the next bucket into it. So the
consumer records an event on its current stream when it hands an arena back (`record`), and the
receive thread waits for that event before the arena is written again (`wait`). On CPU every op
has finished when it returns: no event, nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StreamFence:
    """`current_stream` and `new_event` are torch.cuda's for a CUDA `device` (a test passes fakes)."""

    def __init__(
        self,
        device: torch.device,
        current_stream: Callable[[], Any] | None = None,
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        on_gpu = device.type == "cuda" or current_stream is not None
        self._stream = current_stream or ((lambda: torch.cuda.current_stream(device)) if on_gpu else None)
        self._new_event = new_event or (lambda: torch.cuda.Event())

    def record(self) -> Any | None:
        """On the consumer's thread, when it hands buffers back: an event after the work its stream
        has queued so far (None on CPU)."""
        if self._stream is None:
            return None
        event = self._new_event()
        event.record(self._stream())
        return event

    @staticmethod
    def wait(event: Any | None) -> None:
        """On the thread that writes the buffers next: block until the recorded work is done."""
        if event is not None:
            event.synchronize()
