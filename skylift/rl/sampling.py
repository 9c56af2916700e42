"""How the run samples: the engines' sampling parameters, the distribution the trainer takes the
policy's logprobs of the rollouts under, the per-prompt seeds, and the `Sampler` that asks the
generator for rollouts with them.

`generator.sampling_params` (and `eval_sampling_params`) are read here only: `sampling_params`
builds the engines' request (`SamplingParams`) once per `Sampler`, which hands that object to the
generator; the trainer takes the training `Sampler`'s object (`UpdateSettings.from_config`) and
`trainer_distribution` derives its distribution from it, so the sampler and the trainer cannot
disagree on temperature or truncation.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from skylift.algorithms.sample_support import TokenDistribution, sampled_distribution
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.generator.generator import rollout_seed
from skylift.generator.settings import max_generate_length
from skylift.inference.types import SamplingParams
from skylift.rl.parts import Parts, RolloutGenerator
from skylift.utils.loop_thread import LoopThread


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


def trainer_distribution(params: SamplingParams, replay: bool | None) -> TokenDistribution:
    """The distribution the policy's logprobs of rollouts sampled with `params` are taken under:
    its temperature and, with sampling-support replay (`replay`:
    `trainer.algorithm.enable_sample_support_replay`; None = whenever the request truncates), its
    top-k, top-p and min-p. Greedy requests (temperature 0): the plain distribution."""
    dist = sampled_distribution(params.temperature, params.top_k, params.top_p, params.min_p)
    return dist if (dist.truncates if replay is None else replay) else dist.full()


def rollout_seeds(cfg: SkyliftConfig, rows: Sequence[PromptSample], step: int) -> list[int] | None:
    """One sampling seed per prompt at training step `step` (-1: evaluation) when
    `generator.seeded_sampling`, else None (the engines' own randomness)."""
    if not cfg.generator.seeded_sampling:
        return None
    return [rollout_seed(cfg.trainer.seed, step, row.uid) for row in rows]


@dataclass
class Sampler:
    """Asks the generator for `n` samples per prompt, seeded per (step, prompt)."""

    generator: RolloutGenerator
    loop: LoopThread
    n: int
    params: SamplingParams
    seeds: Callable[[list[PromptSample], int], list[int] | None]
    engine_version: Callable[[], int]

    def coroutine(self, rows: list[PromptSample], step: int) -> Coroutine[Any, Any, list[Trajectory]]:
        """The generation of `rows` as at training step `step` (-1: evaluation); its trajectories
        record the engines' policy version now."""
        return self.generator.generate(
            rows, self.n, self.params, self.engine_version(), self.seeds(rows, step)
        )

    def run(self, rows: list[PromptSample], step: int) -> list[Trajectory]:
        """Generate now, on the run's event loop (from a thread that is not the loop's)."""
        return self.loop.run(self.coroutine(rows, step))


def samplers(cfg: SkyliftConfig, parts: Parts) -> tuple[Sampler, Sampler]:
    """(training, evaluation) samplers: `generator.sampling_params` with logprobs and
    `n_samples_per_prompt`, and `eval_sampling_params` with `eval_n_samples_per_prompt`."""
    g = cfg.generator

    def version() -> int:
        return parts.weights.version

    def training_seeds(rows: list, step: int) -> list[int] | None:
        return rollout_seeds(cfg, rows, step)

    def eval_seeds(rows: list, _step: int) -> list[int] | None:
        return rollout_seeds(cfg, rows, -1)

    train = Sampler(
        parts.generator,
        parts.loop,
        g.n_samples_per_prompt,
        sampling_params(cfg, False),
        training_seeds,
        version,
    )
    evaluation = Sampler(
        parts.generator,
        parts.loop,
        g.eval_n_samples_per_prompt,
        sampling_params(cfg, True),
        eval_seeds,
        version,
    )
    return train, evaluation
