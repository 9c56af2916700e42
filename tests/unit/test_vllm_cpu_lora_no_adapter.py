"""`skylift.inference.vllm_patches.cpu_lora_no_adapter`: vLLM's CPU LoRA ops read the adapter index
-1 (a token without an adapter) as the last slot; patched, such tokens get nothing and every other
token what it got before. Over vLLM's own torch ops and its CPU punica wrapper's names."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.ops import torch_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402

from skylift.inference.vllm_patches import cpu_lora_no_adapter  # noqa: E402

SLOTS, RANK, HIDDEN, OUT = 3, 2, 5, 4


def _stacks() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g)  # vLLM's lora_a_stacked layout
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=g)
    return a, b


def _reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: list[int]) -> torch.Tensor:
    rows = [
        torch.zeros(OUT) if i < 0 else b[i, 0] @ (a[i, 0] @ x[t])  # no adapter: nothing
        for t, i in enumerate(indices)
    ]
    return torch.stack(rows)


def _lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros(x.size(0), RANK)
    y = torch.zeros(x.size(0), OUT)
    punica_cpu.bgmv_shrink(x, a, buffer, indices, 1.0)
    punica_cpu.bgmv_expand(buffer, b, y, indices, True)
    return y


def test_unpatched_ops_give_a_token_without_an_adapter_the_last_slots() -> None:
    a, b = _stacks()
    x = torch.randn(3, HIDDEN)
    buffer = torch.zeros(3, RANK)
    y = torch.zeros(3, OUT)
    indices = torch.tensor([0, -1, 1])
    torch_ops.bgmv_shrink(x, a, buffer, indices, 1.0)
    torch_ops.bgmv_expand(buffer, b, y, indices, True)
    torch.testing.assert_close(y[1], b[SLOTS - 1, 0] @ (a[SLOTS - 1, 0] @ x[1]))  # the bug


def test_patched_ops_give_it_nothing_and_the_others_what_they_had() -> None:
    cpu_lora_no_adapter.install()
    cpu_lora_no_adapter.install()  # idempotent
    a, b = _stacks()
    x = torch.randn(4, HIDDEN)
    for indices in ([0, -1, 2, -1], [2, 1, 0, 1], [-1, -1, -1, -1]):
        got = _lora(x, a, b, torch.tensor(indices))
        torch.testing.assert_close(got, _reference(x, a, b, indices))


def test_one_index_for_every_row_and_the_prefill_ops() -> None:
    cpu_lora_no_adapter.install()
    a, b = _stacks()
    x = torch.randn(5, HIDDEN)
    assert not _lora(x, a, b, torch.tensor([-1])).any()  # one request, no adapter, broadcast
    # prefill: per sequence (lengths 2 and 3), the second one without an adapter
    starts, lengths, per_seq = torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([1, -1])
    buffer, y = torch.zeros(5, RANK), torch.zeros(5, OUT)
    punica_cpu.sgmv_shrink(x, a, buffer, starts, lengths, per_seq, 2, 3, 5, 1.0)
    punica_cpu.sgmv_expand(buffer, b, y, starts, lengths, per_seq, 2, 3, 5, True)
    torch.testing.assert_close(y, _reference(x, a, b, [1, 1, -1, -1, -1]))


def test_prompt_logprobs_add_no_unembedding_delta_on_cpu() -> None:
    """`prompt_logprobs_lora_rows`: while the runner computes prompt logprobs, the CPU wrapper's
    logits op adds nothing (its per-sequence indices do not map prompt rows); otherwise it runs."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from skylift.inference.vllm_patches import prompt_logprobs_lora_rows

    prompt_logprobs_lora_rows.install()
    prompt_logprobs_lora_rows.install()  # idempotent
    a, b = _stacks()

    class Wrapper:  # what add_lora_logits reads of the wrapper
        sampler_indices = torch.tensor([0, 1])

    prompt_rows = torch.randn(10, HIDDEN)  # ten prompt tokens, two sequences' indices: vLLM's crash
    y = torch.zeros(10, OUT)
    prompt_logprobs_lora_rows._scoring_prompts = True
    try:
        PunicaWrapperCPU.add_lora_logits(Wrapper(), y, prompt_rows, a, b, 1.0)
    finally:
        prompt_logprobs_lora_rows._scoring_prompts = False
    assert not y.any()
    x = torch.randn(2, HIDDEN)  # sampling: one row per sequence, each its adapter
    y = torch.zeros(2, OUT)
    PunicaWrapperCPU.add_lora_logits(Wrapper(), y, x, a, b, 1.0)
    torch.testing.assert_close(y, _reference(x, a, b, [0, 1]))
