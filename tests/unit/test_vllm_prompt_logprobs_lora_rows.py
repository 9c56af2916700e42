"""`skylift.inference.vllm_patches.prompt_logprobs_lora_rows` under Model Runner V2 and on CUDA's
punica wrapper: while V2's prompt-logprobs worker computes logits for prompt rows, the
unembedding's LoRA op of both wrappers adds nothing (vLLM maps those rows with one index per
sequence: on CUDA request i's adapter lands on row i of whatever request, vllm-project/vllm#53842);
outside it, vLLM's own op runs. Over vLLM's real classes (V2's worker on a CPU device); the GPU
wrapper's Triton kernels cannot run here, so its op is shown running by its own first check."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker  # noqa: E402

from skylift.inference.vllm_patches import prompt_logprobs_lora_rows  # noqa: E402

HIDDEN, OUT, RANK, SLOTS = 5, 7, 2, 2
PROMPT = 6  # prompt tokens of the one request


class _Stop(Exception):
    """Raised from the logits function once it has seen what it checks (the rest is Triton)."""


def _logits_args(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.zeros(rows, OUT)
    x = torch.randn(rows, HIDDEN, generator=g)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g)
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=g)
    return y, x, a, b


def _token_id_batch() -> SimpleNamespace:
    """V2's `InputBatch` fields `compute_prompt_token_id_logprobs` reads: one request, its whole
    prompt in this step."""
    return SimpleNamespace(
        req_ids=["r"],
        idx_mapping_np=np.array([0]),
        num_computed_prefill_tokens_np=np.array([0]),
        num_scheduled_tokens=np.array([PROMPT]),
        prefill_len_np=np.array([PROMPT]),
        query_start_loc_np=np.array([0, PROMPT]),
    )


def test_gpu_wrapper_runs_vllms_op_outside_prompt_scoring() -> None:
    prompt_logprobs_lora_rows.install()
    y, x, a, b = _logits_args(3)
    with pytest.raises(AssertionError, match="buffer should be created"):  # vLLM's op, its first check
        PunicaWrapperGPU.add_lora_logits(SimpleNamespace(), y, x, a, b, 1.0, buffer=torch.empty(1))


def test_v2_prompt_rows_get_no_unembedding_delta_from_either_wrapper() -> None:
    prompt_logprobs_lora_rows.install()
    prompt_logprobs_lora_rows.install()  # idempotent
    worker = PromptLogprobsWorker(max_num_reqs=2, device=torch.device("cpu"))
    ids = np.arange(2 * (PROMPT - 1)).reshape(PROMPT - 1, 2)  # two ids scored per prompt row
    worker.add_request("r", 0, SamplingParams(prompt_logprob_token_ids=ids))
    seen: list[object] = []

    def logits_fn(rows: torch.Tensor) -> torch.Tensor:
        y, x, a, b = _logits_args(rows.shape[0])  # one row per prompt token, not per sequence
        seen.append(
            PunicaWrapperGPU.add_lora_logits(SimpleNamespace(), y, x, a, b, 1.0, buffer=torch.empty(1))
        )
        seen.append(
            PunicaWrapperCPU.add_lora_logits(
                SimpleNamespace(sampler_indices=torch.tensor([0])), y, x, a, b, 1.0
            )
        )
        seen.append(bool(y.any()))
        raise _Stop

    hidden = torch.randn(PROMPT, HIDDEN)
    with pytest.raises(_Stop):
        worker.compute_prompt_token_id_logprobs(logits_fn, hidden, _token_id_batch(), np.array([PROMPT]))  # type: ignore[arg-type]
    assert seen == [None, None, False]  # neither op ran, nothing added
    assert not prompt_logprobs_lora_rows._scoring_prompts  # cleared on the way out


def test_v2_top_k_prompt_logprobs_are_scored_without_deltas() -> None:
    """`compute_prompt_logprobs` (top-k prompt logprobs) runs under the flag too: seen through the
    first field of the batch it reads (its logits come after a Triton kernel)."""
    prompt_logprobs_lora_rows.install()
    flags: list[bool] = []

    class Batch:
        @property
        def idx_mapping_np(self) -> np.ndarray:
            flags.append(prompt_logprobs_lora_rows._scoring_prompts)
            raise _Stop

    worker = PromptLogprobsWorker(max_num_reqs=2, device=torch.device("cpu"))
    with pytest.raises(_Stop):
        worker.compute_prompt_logprobs(None, None, Batch(), None, None, np.array([PROMPT]))  # type: ignore[arg-type]
    assert flags == [True]
    assert not prompt_logprobs_lora_rows._scoring_prompts
