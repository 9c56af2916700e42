"""`generator.sampling_params.*` and `generator.eval_sampling_params.*`: the sampling parameters
passed to the inference engines (re-exported by `skylift.config.schema`)."""

from __future__ import annotations

from dataclasses import dataclass

from skylift.config.fields import _f


@dataclass
class SamplingConfig:
    """Sampling parameters passed to the inference engines."""

    max_generate_length: int = _f(
        256, "most new tokens per response (generator.max_generate_length wins if set)", ge=1
    )
    temperature: float = _f(1.0, "sampling temperature; 0 = greedy", ge=0)
    top_p: float = _f(1.0, "nucleus sampling probability mass", gt=0, le=1)
    top_k: int = _f(-1, "sample among the k most likely tokens; -1 = all")
    min_p: float = _f(0.0, "drop tokens below min_p times the top token's probability", ge=0, le=1)
    repetition_penalty: float = _f(1.0, "penalty on repeated tokens; 1 = none", gt=0)
    logprobs: int | None = _f(  # accepted without effect: see skylift.config.inert
        0, "accepted for compatibility, no effect in skylift (where it has one: top logprobs per token)", ge=0
    )
    stop: list[str] | None = _f(None, "extra stop strings; null = only the tokenizer's EOS")


@dataclass
class EvalSamplingConfig(SamplingConfig):
    """Sampling parameters for evaluation: greedy by default, length defaults to training's."""

    max_generate_length: int | None = _f(
        None, "most new tokens per response; null = the training value", ge=1
    )
    temperature: float = _f(0.0, "sampling temperature; 0 = greedy", ge=0)
