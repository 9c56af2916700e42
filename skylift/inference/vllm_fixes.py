"""Fixes to vLLM: in every engine worker (`install`, imported by the worker extension), and a quiet
finaliser for the driver's `AsyncLLM` (`quiet_teardown`).

Seeded requests on CPU. When the scheduler splits a prompt across steps (chunked prefill, e.g. under
load: the step's token budget runs out mid-prompt), vLLM samples a token for the partial prefill,
discards it, and rewinds the request's generator with ``gen.set_offset(gen.get_offset() - 4)``
(`GPUModelRunner._bookkeeping_sync`, vLLM 0.32). CPU generators have no offset: the call raises
"CPU Generator does not use offset", the engine core dies and the server answers 500 to every
request from then on. Any request with a ``seed`` triggers it once its prompt is split. On CPU,
`install` instead saves those generators' states before sampling and restores them afterwards,
which is what the rewind means (the discarded sample leaves no trace in the seeded stream), and
hides them from the rewind loop. Other devices are untouched.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


def _discarded_cpu_generators(runner: Any) -> dict[int, torch.Generator]:
    """Generators of this step's requests whose sampled token will be discarded (CPU only)."""
    if runner.device.type != "cpu":
        return {}
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    if not generators:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): generators[int(i)] for i in rows if int(i) in generators}


def install() -> bool:
    """Patch vLLM's model runner (idempotent). False when vLLM's runner lacks what is patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_skylift_cpu_seed_fix", False):
        return True
    if not all(hasattr(GPUModelRunner, name) for name in ("_sample", "_bookkeeping_sync")):
        return False
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: gen.get_state() for i, gen in _discarded_cpu_generators(self).items()}
        output = sample(self, *args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return output

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = _discarded_cpu_generators(self)
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner._skylift_cpu_seed_fix = True
    return True


def quiet_teardown(cls: type) -> None:
    """Make `cls.__del__` ignore errors: after `close()`, AsyncLLM's finaliser may still run during
    interpreter teardown, when module globals are already None, and print a spurious TypeError."""
    original = cls.__dict__.get("__del__")
    if original is None or getattr(original, "_skylift_quiet", False):
        return

    def __del__(self: Any) -> None:
        try:
            original(self)
        except Exception:  # noqa: BLE001 - nothing useful can happen in a finaliser at exit
            pass

    __del__._skylift_quiet = True  # type: ignore[attr-defined]
    cls.__del__ = __del__  # type: ignore[attr-defined]
