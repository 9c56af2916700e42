"""How the run samples: the engines' sampling parameters and the per-prompt seeds."""

from __future__ import annotations

from collections.abc import Sequence

from skylift.cluster.settings import max_generate_length
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptSample
from skylift.generator.generator import rollout_seed
from skylift.inference.types import SamplingParams


def sampling_params(cfg: SkyliftConfig, evaluation: bool) -> SamplingParams:
    """`generator.sampling_params` for training rollouts (with logprobs), `eval_sampling_params`
    for evaluation."""
    g = cfg.generator
    sp = g.eval_sampling_params if evaluation else g.sampling_params
    max_tokens = sp.max_generate_length if evaluation and sp.max_generate_length else max_generate_length(cfg)
    return SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        max_tokens=int(max_tokens),
        stop=list(sp.stop) if sp.stop else None,
        logprobs=not evaluation,
    )


def rollout_seeds(cfg: SkyliftConfig, rows: Sequence[PromptSample], step: int) -> list[int] | None:
    """One sampling seed per prompt at training step `step` (-1: evaluation) when
    `generator.seeded_sampling`, else None (the engines' own randomness)."""
    if not cfg.generator.seeded_sampling:
        return None
    return [rollout_seed(cfg.trainer.seed, step, row.uid) for row in rows]
