"""Workaround: prompt logprobs under a LoRA adapter of the unembedding are scored on merged weights.

vLLM computes prompt logprobs with one hidden-state row per prompt token, but applies an
``lm_head`` adapter with the LoRA mapping of the batch's *sequences*: on CUDA the adapter's delta
is silently left out of ``prompt_logprobs`` (the numbers look plausible and are wrong), on CPU the
punica wrapper's ``bgmv_shrink`` raises ("einsum(): subscript b has size 2 ... size 13") and the
engine process dies, taking every user's requests with it (found by
``benchmarks/tinker_multi_lora.py``: ``compute_logprobs`` of a SmolLM2 sampler with Tinker's
default ``train_unembed``). Generation logprobs are right on both.

What skylift does: nothing is patched inside vLLM; callers that score a prompt under an adapter
ask `adapter_may_score_prompts` first, and the Tinker sampler serves such a request of an
unembedding adapter on its merged weights (a weight swap) instead of as an adapter in the batch.

Upstream: vllm-project/vllm#51594 ("LoRA lm_head delta is silently dropped from
prompt_logprobs"), fix proposed in vllm-project/vllm#51597. Removable when the pinned vLLM
includes that fix: then `adapter_may_score_prompts` returns True for every adapter (check with
``tests/tinker/test_shared_base.py``'s unembedding test on a Llama-family model).
"""

from __future__ import annotations

NAME = "lora_prompt_logprobs"
WRITTEN_FOR = "==0.32.*"


def adapter_may_score_prompts(adapts_unembedding: bool) -> bool:
    """Whether vLLM scores prompt tokens correctly under an adapter (of the unembedding or not)."""
    return not adapts_unembedding
