"""Patch: on CPU, a token without an adapter gets no adapter's delta in a LoRA-enabled engine.

vLLM marks a token whose request has no LoRA adapter with the adapter index -1. Its GPU kernels
skip such tokens; the CPU's torch ops (`vllm.lora.ops.torch_ops`, used by `PunicaWrapperCPU`)
index the stacked adapter weights with it, and ``weights[-1]`` is the *last* adapter slot. The
prefill paths return early only when no request of the batch has an adapter; the decode paths and
the logits (``add_lora_logits``, an adapter of the unembedding) never do. So once the engine has
``max_loras`` adapters active, a request for the base model, or for merged weights swapped in
(the Tinker sampler's swap path), is scored and sampled under the last slot's adapter: found as a
0.01-0.03 nat gap between a Tinker sampler's ``compute_logprobs`` and its training forward with 4
or 8 adapters loaded (2.3e-5 with 2, when the last slot was still empty).

`install` wraps the six ops where `PunicaWrapperCPU` looks them up: a shrink writes zeros for
tokens with index -1, an expand adds nothing for them (its input rows zeroed); tokens with an
adapter are computed as before. Other devices' wrappers are untouched.

Upstream: no issue filed (vLLM 0.32's ``vllm/lora/ops/torch_ops/lora_ops.py`` indexes with -1;
the GPU's triton ops and vllm-project/vllm#51594's neighbourhood assume -1 is skipped). Removable
when those torch ops mask negative indices (check ``bgmv_shrink`` for a ``>= 0`` mask).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "cpu_lora_no_adapter"
WRITTEN_FOR = "==0.32.*"

_SHRINKS = ("bgmv_shrink", "sgmv_shrink")
_EXPANDS = ("bgmv_expand", "bgmv_expand_slice", "sgmv_expand", "sgmv_expand_slice")


def _token_indices(name: str, args: tuple[Any, ...]) -> tuple[torch.Tensor, int]:
    """Each token's adapter index, and where the index argument sits in `args` (bgmv: per token;
    sgmv: per sequence, with the sequences' lengths after the start offsets)."""
    if name.startswith("bgmv"):
        return args[3], 3
    return torch.repeat_interleave(args[5], args[4]), 5


def _zero_rows(tensor: torch.Tensor, none: torch.Tensor) -> None:
    """Zero the rows of tokens without an adapter (every row where one index covers them all)."""
    if none.numel() == 1:
        tensor.zero_()
    else:
        tensor[: none.numel()][none] = 0


def _masked(name: str, op: Callable[..., Any], shrink: bool) -> Callable[..., Any]:
    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        indices, at = _token_indices(name, args)
        none = indices < 0
        if not bool(none.any()):
            return op(*args, **kwargs)
        fixed = list(args)
        fixed[at] = fixed[at].clamp(min=0)
        if shrink:  # the output (args[2]): nothing for them
            out = op(*fixed, **kwargs)
            _zero_rows(fixed[2], none)
            return out
        fixed[0] = fixed[0].clone()  # the input (a shrink's output): zero for them, so they add nothing
        _zero_rows(fixed[0], none)
        return op(*fixed, **kwargs)

    run._skylift_masked = True  # type: ignore[attr-defined]
    return run


def install() -> None:
    """Wrap the CPU wrapper's LoRA ops (idempotent); `VllmPatchVersionError` on a vLLM it does not fit."""
    guard(NAME, WRITTEN_FOR)
    from vllm.lora.punica_wrapper import punica_cpu

    for name in (*_SHRINKS, *_EXPANDS):
        op = getattr(punica_cpu, name, None)
        if op is None:
            raise missing_target(NAME, f"vllm.lora.punica_wrapper.punica_cpu.{name}")
        if not getattr(op, "_skylift_masked", False):
            setattr(punica_cpu, name, _masked(name, op, name in _SHRINKS))
