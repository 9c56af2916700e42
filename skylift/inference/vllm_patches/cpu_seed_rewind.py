"""Patch: seeded requests on CPU survive vLLM's rewind of a discarded sample.

When the scheduler splits a prompt across steps (chunked prefill, e.g. under load: the step's
token budget runs out mid-prompt), vLLM samples a token for the partial prefill, discards it, and
rewinds the request's generator with ``gen.set_offset(gen.get_offset() - 4)``
(`GPUModelRunner._bookkeeping_sync`, vLLM 0.32). CPU generators have no offset: the call raises
"CPU Generator does not use offset", the engine core dies and the server answers 500 to every
request from then on. Any request with a ``seed`` triggers it once its prompt is split. On CPU,
`install` instead saves those generators' states before sampling and restores them afterwards,
which is what the rewind means (the discarded sample leaves no trace in the seeded stream), and
hides them from the rewind loop. Other devices are untouched.

Upstream: the rewind came with vllm-project/vllm#10097 and assumes CUDA's Philox generators (the
same crash on another CPU-generator backend: RBLN-SW/vllm-rbln#1025). Removable when vLLM's model
runner no longer calls ``set_offset`` on CPU generators (check `_bookkeeping_sync`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from skylift.inference.vllm_patches.versions import guard, missing_target


def _discarded_cpu_generators(runner: Any) -> dict[int, torch.Generator]:
    """Generators of this step's requests whose sampled token will be discarded (CPU only)."""
    if runner.device.type != "cpu":
        return {}
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    if not generators:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): generators[int(i)] for i in rows if int(i) in generators}


NAME = "cpu_seed_rewind"
WRITTEN_FOR = "==0.32.*"


def install() -> None:
    """Patch vLLM's model runner (idempotent); `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_skylift_cpu_seed_fix", False):
        return
    if not all(hasattr(GPUModelRunner, name) for name in ("_sample", "_bookkeeping_sync")):
        raise missing_target(NAME, "GPUModelRunner._sample / _bookkeeping_sync")
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
