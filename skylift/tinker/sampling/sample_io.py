"""A Tinker sample request as the engine takes it and its answer as the service returns it.

The SDK's ``sampling_params`` become the engine's `SamplingParams` (`to_engine_params`); what a
request asks about its prompt is a `PromptScores`; the engine's outputs for one request become a
`SampleResult` (`text_result`; `image_result` for a prompt with images). The engine itself, and
which weights it samples with, is `skylift.tinker.sampling.engine_host`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skylift.inference.types import EngineError, SamplingParams
from skylift.tinker.core.wire import SampledSequenceData


@dataclass
class PromptScores:
    """What a sample request asks about its prompt: logprobs, the top-k tokens per position, and
    the logprobs of given tokens (``targets[i, j]`` scored at position ``i + 1``; -1: none)."""

    logprobs: bool = False
    topk: int = 0
    targets: np.ndarray | None = None

    def target_sequences(self, prompt: list[int]) -> list[tuple[int, int, list[int]]]:
        """(row, column, prompt[: row + 1] + [token]) of every requested cell: the engine scores
        the last token of each sequence (shared prefixes hit its prefix cache)."""
        if self.targets is None:
            return []
        cells = np.argwhere(self.targets >= 0)
        return [(int(i), int(j), [*prompt[: i + 1], int(self.targets[i, j])]) for i, j in cells]


@dataclass
class SampleResult:
    sequences: list[SampledSequenceData]
    prompt_logprobs: list[float] | None
    topk_prompt: list[list[tuple[int, float]] | None] | None = None
    target_prompt: np.ndarray | None = None
    prompt_cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (once per prompt)


def text_result(
    results: Sequence[Any], scores: PromptScores, targets: list[tuple[int, int, list[int]]]
) -> SampleResult:
    """The engine's answers to one request, in order: `generate`'s outputs, then the prompt's
    logprobs, its top-k tokens and the `targets`' sequences scored (`scores.target_sequences`),
    each None where `scores` did not ask for it."""
    sequences = []
    for completion in results[0][0].completions:
        if completion.stop_reason not in ("stop", "length"):
            raise EngineError(f"generation ended with {completion.stop_reason!r}")
        sequences.append(
            SampledSequenceData(
                tokens=list(completion.token_ids),
                logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
                stop_reason=completion.stop_reason,
                top_logprobs=completion.top_logprobs,
            )
        )
    plp = None
    if scores.logprobs:
        plp = [math.nan] + (list(results[1][0]) if results[1] is not None else [])
    topk = None
    if scores.topk:
        topk = [None, *results[2]] if results[2] is not None else [None]
    target = None
    if scores.targets is not None:
        target = np.zeros(scores.targets.shape, dtype=np.float32)  # 0.0 where nothing was asked
        for (i, j, _), values in zip(targets, results[3] or [], strict=True):
            target[i, j] = values[-1]
    cached = results[0][0].prompt_cached_tokens
    return SampleResult(sequences, plp, topk, target, prompt_cached_tokens=cached)


def image_result(output: Any) -> SampleResult:
    """The engine's output for one prompt with images (no prompt scores)."""
    sequences = [
        SampledSequenceData(
            tokens=list(c.token_ids),
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            stop_reason=c.stop_reason,
        )
        for c in output.completions
    ]
    return SampleResult(
        sequences=sequences, prompt_logprobs=None, prompt_cached_tokens=output.prompt_cached_tokens
    )


def to_engine_params(
    raw: dict[str, Any], prompt_len: int, max_model_len: int, num_samples: int
) -> SamplingParams:
    """Tinker `sampling_params` JSON as engine `SamplingParams` (stop: None = EOS, [] = never)."""
    from skylift.tinker.errors import UserError

    room = max_model_len - prompt_len
    if room < 1:
        raise UserError(f"prompt of {prompt_len} tokens leaves no room in the context of {max_model_len}")
    max_tokens = raw.get("max_tokens")
    max_tokens = room if max_tokens is None else int(max_tokens)
    if max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise UserError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length {max_model_len}"
        )
    stop = raw.get("stop")
    stop_strs: list[str] | None = None
    stop_ids: list[int] | None = None
    ignore_eos = False
    if isinstance(stop, str):
        stop_strs = [stop]
    elif isinstance(stop, list):
        if not stop:
            ignore_eos = True
        elif all(isinstance(s, str) for s in stop):
            stop_strs = list(stop)
        elif all(isinstance(s, int) for s in stop):
            stop_ids = list(stop)
        else:
            raise UserError(f"sampling_params.stop must be strings or token ids, not a mix: {stop!r}")
    elif stop is not None:
        raise UserError(f"sampling_params.stop must be a string, a list or null, got {stop!r}")
    temperature = float(raw.get("temperature", 1.0))
    if temperature < 0:
        raise UserError(f"sampling_params.temperature must be >= 0, got {temperature}")
    seed = raw.get("seed")
    return SamplingParams(
        temperature=temperature,
        top_p=float(raw.get("top_p", 1.0)),
        top_k=int(raw.get("top_k", -1)),
        max_tokens=max_tokens,
        stop=stop_strs,
        stop_token_ids=stop_ids,
        seed=None if seed is None else int(seed) % (2**63 - 1),
        n=num_samples,
        logprobs=True,
        ignore_eos=ignore_eos,
    )


__all__ = ["PromptScores", "SampleResult", "image_result", "text_result", "to_engine_params"]
