"""vLLM's outputs -> skylift's: the one place that reads vLLM's `RequestOutput`.

`LocalVLLMEngine` (and through it every transport: in process, HTTP, Ray) builds vLLM's request
itself (`skylift.inference.local`: the prompt, its images, the LoRA request and `to_vllm_params`)
and reads vLLM's final `RequestOutput` with `to_generate_output`.
"""

from __future__ import annotations

import logging
from typing import Any

from skylift.inference.types import Completion, EngineError, GenerateOutput, StopReason

logger = logging.getLogger(__name__)

#: vLLM finish reasons skylift passes on as they are; any other ends as "abort" (the sample did
#: not finish normally: callers drop or zero it, as for an aborted request).
_STOP_REASONS: tuple[StopReason, ...] = ("stop", "length", "abort")


def stop_reason(finish_reason: str | None) -> StopReason:
    """Our stop reason for vLLM's finish reason (see `_STOP_REASONS`)."""
    for reason in _STOP_REASONS:
        if finish_reason == reason:
            return reason
    logger.warning("vLLM finished a sample with %r: reported as 'abort'", finish_reason)
    return "abort"


def _top(position: Any, k: int) -> list[tuple[int, float]]:
    """The entries of one vLLM logprobs dict ranked 1..k, most likely first."""
    ranked = sorted((p.rank, tok, float(p.logprob)) for tok, p in position.items() if p.rank <= k)
    return [(tok, lp) for _, tok, lp in ranked]


def prompt_top_logprobs(final: Any, prompt: list[int], k: int) -> list[list[tuple[int, float]]]:
    """The `k` most likely tokens (id, logprob) at every prompt position after the first."""
    entries = final.prompt_logprobs
    if entries is None or len(entries) != len(prompt):
        raise EngineError("vLLM returned no prompt logprobs")
    return [_top(pos, k) for pos in entries[1:]]


def _completion(output: Any, want_logprobs: bool, top: int = 0) -> Completion:
    token_ids = list(output.token_ids)
    logprobs: list[float] | None = None
    if want_logprobs:
        if output.logprobs is None or len(output.logprobs) != len(token_ids):
            raise EngineError("vLLM returned no logprob for some sampled tokens")
        logprobs = [float(pos[tok].logprob) for tok, pos in zip(token_ids, output.logprobs, strict=True)]
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        stop_reason=stop_reason(output.finish_reason),
        text=output.text,
        matched_stop=output.stop_reason,
        top_logprobs=[_top(pos, top) for pos in output.logprobs or []] if top > 0 else None,
        token_versions=token_versions(getattr(output, "weight_versions", None), len(token_ids)),
        routed_experts=getattr(output, "routed_experts", None),  # engines started to return them
    )


def token_versions(spans: Any, num_tokens: int) -> list[int] | None:
    """Per token, the policy version vLLM labelled it with (its `WeightVersionSpan`s over the
    output tokens), or None when a span has no integer label (vLLM's "default": never set)."""
    if not spans:
        return None
    out: list[int] = []
    for span in spans:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            return None
        out.extend([version] * (int(span.end) - int(span.start)))
    return out if len(out) == num_tokens else None


def _prompt_logprobs(prompt: list[int], entries: Any) -> list[float | None]:
    if entries is None or len(entries) != len(prompt):
        raise EngineError("vLLM returned no prompt logprobs")
    return [
        None if entry is None else float(entry[tok].logprob)
        for tok, entry in zip(prompt, entries, strict=True)
    ]


def to_generate_output(
    final: Any,
    prompt: list[int],
    *,
    want_logprobs: bool,
    prompt_logprobs: bool = False,
    top_logprobs: int = 0,
) -> GenerateOutput:
    """All samples of one prompt from vLLM's final `RequestOutput`, in sample order."""
    return GenerateOutput(
        prompt_token_ids=list(prompt),
        completions=[
            _completion(out, want_logprobs, top_logprobs)
            for out in sorted(final.outputs, key=lambda o: o.index)
        ],
        prompt_logprobs=_prompt_logprobs(prompt, final.prompt_logprobs) if prompt_logprobs else None,
        prompt_cached_tokens=int(final.num_cached_tokens or 0),  # None before vLLM counted it
    )
