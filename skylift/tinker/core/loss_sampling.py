"""The distribution a Tinker RL loss scores tokens under: sampling-support replay for the service.

A sampler reports each sampled token's logprob under the distribution it drew the token from
(vLLM's processed logprobs: temperature, then min-p, top-k and top-p, renormalised over the tokens
left; `skylift.algorithms.sample_support`). The RL losses compare the trainer's logprob with that
``logprobs`` input, so the trainer must score the token under the same distribution: otherwise
every ratio is biased as soon as sampling truncates or the temperature is not 1, and tokens the
sampler could not have drawn get gradient.

The SDK sends no sampling parameters with training data, and a client may sample anywhere, so
the client names them in ``loss_fn_config`` with the values it sampled with: ``temperature``,
``top_k``, ``top_p`` (the SDK's ``SamplingParams`` fields) and ``min_p`` (for logprobs sampled
elsewhere, e.g. by ``skylift serve``). The server knows them itself only for sequences it recorded
(a sampler created with ``record_stability_info=True``) that a datum names in its provenance
spans: when every sampled span of a request names such a record, `recorded_config` fills the keys
in (and refuses keys that contradict the records). Otherwise, without the keys, the trainer scores
``log_softmax(logits)`` (temperature 1, no truncation), as the Tinker API does. Temperature 0
(greedy) scores at temperature 1 untruncated: vLLM applies no truncation to greedy requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from skylift.algorithms.sample_support import TokenDistribution, sampled_distribution
from skylift.tinker.errors import UserError

#: ``loss_fn_config`` keys naming the sampling parameters of the ``logprobs`` input.
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


def _value(config: Mapping[str, float | str], key: str, default: float) -> float:
    raw = config.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError) as exc:
        raise UserError(f"loss_fn_config[{key!r}] must be a number, got {raw!r}") from exc
    if not math.isfinite(value):
        raise UserError(f"loss_fn_config[{key!r}] must be finite, got {raw!r}")
    return value


def loss_distribution(config: Mapping[str, float | str]) -> TokenDistribution:
    """The `TokenDistribution` the sampling keys of `config` name (a user error for bad values)."""
    temperature = _value(config, "temperature", 1.0)
    top_p = _value(config, "top_p", 1.0)
    top_k = _value(config, "top_k", -1)
    min_p = _value(config, "min_p", 0.0)
    if temperature < 0:
        raise UserError(f"loss_fn_config['temperature'] must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"loss_fn_config['top_p'] must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:
        raise UserError(f"loss_fn_config['min_p'] must be in [0, 1], got {min_p}")
    if top_k != int(top_k) or top_k < -1:
        raise UserError(f"loss_fn_config['top_k'] must be an integer >= -1 (-1 or 0 = off), got {top_k}")
    return sampled_distribution(temperature, int(top_k), top_p, min_p)


def as_config(dist: TokenDistribution) -> dict[str, float | str]:
    """The ``loss_fn_config`` keys that name `dist`."""
    return {
        "temperature": dist.temperature,
        "top_k": float(dist.top_k),
        "top_p": dist.top_p,
        "min_p": dist.min_p,
    }


def recorded_config(
    config: Mapping[str, float | str], recorded: set[TokenDistribution] | None
) -> dict[str, float | str]:
    """`config` with the sampling keys of the distribution every sampled position was recorded
    with (`recorded`: None when some sampled position has no record; then `config` as it is)."""
    if not recorded:
        return dict(config)
    if len(recorded) > 1:
        raise UserError(
            "the data names sequences sampled with different sampling parameters "
            f"({sorted(map(str, recorded))}); send them in separate requests"
        )
    [dist] = recorded
    if not any(key in config for key in SAMPLING_KEYS):
        return {**config, **as_config(dist)}
    if loss_distribution(config) != dist:
        raise UserError(
            f"loss_fn_config names {loss_distribution(config)} but the sequences the data names were "
            f"sampled with {dist}"
        )
    return dict(config)


__all__ = ["SAMPLING_KEYS", "as_config", "loss_distribution", "recorded_config", "sampled_distribution"]
