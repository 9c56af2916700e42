"""Patch: on CPU, prompt logprobs in a LoRA-enabled engine no longer kill the engine process.

vLLM scores a request's prompt tokens (``prompt_logprobs``) by computing logits for one hidden
state per prompt token (`GPUModelRunner._get_prompt_logprobs_dict`), while the unembedding's
LoRA wrapper (``add_lora_logits``) maps rows to adapters with the batch's *sampling* indices, one
per sequence. On CUDA the adapter's delta is silently left out (vllm-project/vllm#51594); on CPU
`PunicaWrapperCPU` feeds the mismatched indices to ``einsum`` ("subscript b has size 2 ... size
10") whenever two or more sequences share the step, and the engine process dies for every user
(found with two Tinker samplers of SmolLM2 in one batch).

`install` makes the CPU wrapper add no adapter delta to the logits while prompt logprobs are
computed: the CUDA behaviour, without the crash. skylift's Tinker sampler scores prompts of an
adapter of the unembedding on merged weights (`lora_prompt_logprobs`), so what it returns is
right; other adapters leave the unembedding alone and add nothing there anyway.

Upstream: vllm-project/vllm#51594 (fix proposed in vllm-project/vllm#51597, CUDA only) and
vllm-project/vllm#29955 (the crash). Removable when the pinned vLLM maps prompt-logprob rows to
their adapters on CPU (``PunicaWrapperCPU.add_lora_logits`` with per-token indices).
"""

from __future__ import annotations

import functools
from typing import Any

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "cpu_prompt_logprobs_lora"
WRITTEN_FOR = "==0.32.*"

_scoring_prompts = False  # True while this worker computes prompt logprobs (one thread per worker)


def install() -> None:
    """Wrap the model runner's prompt-logprobs step and the CPU wrapper's logits op (idempotent);
    `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(PunicaWrapperCPU, "_skylift_prompt_logprobs", False):
        return
    if not hasattr(GPUModelRunner, "_get_prompt_logprobs_dict"):
        raise missing_target(NAME, "GPUModelRunner._get_prompt_logprobs_dict")
    if not hasattr(PunicaWrapperCPU, "add_lora_logits"):
        raise missing_target(NAME, "PunicaWrapperCPU.add_lora_logits")
    prompt_logprobs, add_lora_logits = (
        GPUModelRunner._get_prompt_logprobs_dict,
        PunicaWrapperCPU.add_lora_logits,
    )

    @functools.wraps(prompt_logprobs)
    def _get_prompt_logprobs_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _scoring_prompts
        _scoring_prompts = True
        try:
            return prompt_logprobs(self, *args, **kwargs)
        finally:
            _scoring_prompts = False

    @functools.wraps(add_lora_logits)
    def _add_lora_logits(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _scoring_prompts:
            return None  # rows are prompt tokens, the indices sequences: no mapping to apply
        return add_lora_logits(self, *args, **kwargs)

    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    PunicaWrapperCPU.add_lora_logits = _add_lora_logits
    PunicaWrapperCPU._skylift_prompt_logprobs = True
