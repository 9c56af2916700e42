"""Patch: prompt logprobs in a LoRA-enabled engine add no unembedding delta (CPU and CUDA, both
model runners) instead of killing the engine or mixing other requests' adapters into them.

vLLM scores a request's prompt tokens (``prompt_logprobs``) by computing logits for one hidden
state per prompt token (V1: `GPUModelRunner._get_prompt_logprobs_dict`; Model Runner V2, CUDA's
default: `PromptLogprobsWorker.compute_prompt_logprobs` and ``compute_prompt_token_id_logprobs``,
over chunks of the whole batch's rows), while the unembedding's LoRA wrapper (``add_lora_logits``)
maps rows to adapters with the batch's *sampling* indices, one per sequence. On CPU,
`PunicaWrapperCPU` feeds the mismatched indices to ``einsum`` ("subscript b has size 2 ... size
10") whenever two or more sequences share the step, and the engine process dies for every user
(found with two Tinker samplers of SmolLM2 in one batch). On CUDA, `PunicaWrapperGPU`'s kernels
add request i's adapter delta to row i of each logits call (the first rows of the batch's prompt
chunk, whichever request they belong to) and nothing to the rest (read in vLLM 0.32's
``punica_gpu.py`` and ``lora_kernel_metadata.py``; vllm-project/vllm#53842 measured it on V2, with
CUDA memory errors besides).

`install` makes both wrappers add no adapter delta to the logits while prompt logprobs are
computed, under either runner: no crash, and no request's adapter in another's prompt scores.
skylift's Tinker sampler scores prompts of an adapter of the unembedding on merged weights
(`lora_prompt_logprobs`), so what it returns is right; other adapters leave the unembedding alone
and add nothing there anyway. Generation logprobs are untouched (their rows are the sequences').

Upstream: vllm-project/vllm#51594 (V1 fix proposed in vllm-project/vllm#51597, V2's in
vllm-project/vllm#53842) and vllm-project/vllm#29955 (the crash). Removable when the pinned vLLM
maps prompt-logprob rows to their adapters in both runners (``add_lora_logits`` with per-token
indices while prompt logits are computed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "prompt_logprobs_lora_rows"
WRITTEN_FOR = "==0.32.*"

_scoring_prompts = False  # True while this worker computes prompt logprobs (one thread per worker)


def _scoring(compute: Callable[..., Any]) -> Callable[..., Any]:
    """`compute` (a runner's prompt-logprobs step) with `_scoring_prompts` set while it runs."""

    @functools.wraps(compute)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _scoring_prompts
        _scoring_prompts = True
        try:
            return compute(*args, **kwargs)
        finally:
            _scoring_prompts = False

    return run


def _no_delta_while_scoring(add_lora_logits: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(add_lora_logits)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _scoring_prompts:
            return None  # rows are prompt tokens, the indices sequences: no mapping to apply
        return add_lora_logits(self, *args, **kwargs)

    return run


def _targets() -> list[tuple[type, str, Callable[..., Callable[..., Any]]]]:
    """(class, method, wrapper) of every method patched: both runners' prompt-logprobs steps, both
    punica wrappers' logits op."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return [
        (GPUModelRunner, "_get_prompt_logprobs_dict", _scoring),
        (PromptLogprobsWorker, "compute_prompt_logprobs", _scoring),
        (PromptLogprobsWorker, "compute_prompt_token_id_logprobs", _scoring),
        (PunicaWrapperCPU, "add_lora_logits", _no_delta_while_scoring),
        (PunicaWrapperGPU, "add_lora_logits", _no_delta_while_scoring),
    ]


def install() -> None:
    """Wrap both model runners' prompt-logprobs steps and both punica wrappers' logits op
    (idempotent); `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    targets = _targets()
    for cls, name, _ in targets:
        if not hasattr(cls, name):
            raise missing_target(NAME, f"{cls.__name__}.{name}")
    for cls, name, wrap in targets:
        method = getattr(cls, name)
        if not getattr(method, "_skylift_prompt_logprobs", False):
            wrapped = wrap(method)
            wrapped._skylift_prompt_logprobs = True  # type: ignore[attr-defined]
            setattr(cls, name, wrapped)
