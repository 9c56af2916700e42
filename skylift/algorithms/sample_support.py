"""Sampling-support replay: token logprobs under the distribution the engine sampled from.

vLLM (V1 sampler, ``logprobs_mode="processed_logprobs"``) samples a token from the logits after:

1. temperature: ``logits / T`` (greedy, T = 0, skips every step below);
2. min-p: drop tokens whose probability (softmax of 1.) is below ``min_p`` times the largest one;
3. top-k: drop tokens whose logit is below the k-th largest logit (ties with it all stay);
4. top-p: sort the logits ascending, softmax over what steps 2-3 left, and drop the tokens whose
   ascending cumulative probability is ``<= 1 - top_p``; the most likely token always stays
   (tokens with equal logits straddling the cut are kept in the order ``torch.sort`` puts them);

and reports the log-softmax of what is left: the renormalised distribution over the *support*.
A trainer that scores the same tokens under ``log_softmax(logits / T)`` disagrees with every
rollout logprob as soon as the support is truncated, and its loss sends gradient to tokens the
engine could never have sampled. `token_logprobs` replays the engine's processing on the
trainer's logits: outside the support a token has no probability and its logit gets no
gradient. The sampled token always belongs to the support (the engine sampled it): when the
trainer's recomputation leaves it out, through numerical differences at the edge, it is added back.

Only the PyTorch (CPU, and GPU without Triton) order of ties is replayed exactly; vLLM's Triton
top-k kernel on GPU keeps exactly k tokens when several tie with the k-th.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenDistribution:
    """How the engine turned logits into the distribution it sampled from (vLLM's sampling
    parameters of the same names; ``top_k`` <= 0 or >= the vocabulary, ``top_p`` = 1 and
    ``min_p`` = 0 are off)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy scores at 1), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def truncates(self) -> bool:
        """Whether some token can lie outside the support (any of top-k, top-p, min-p on)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def full(self) -> TokenDistribution:
        """The same temperature, untruncated (what the KL to the reference and evaluation use)."""
        return TokenDistribution(temperature=self.temperature)


def sampled_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> TokenDistribution:
    """The distribution vLLM samples from with these sampling parameters (greedy, temperature 0:
    temperature 1 and nothing cut, as vLLM applies no truncation to greedy requests; top_k <= 0
    is off and reads -1, so that equal distributions compare equal). The RL trainer
    (`skylift.rl.sampling.trainer_distribution`) and the Tinker service take theirs from here."""
    if temperature <= 0:
        return TokenDistribution()
    return TokenDistribution(
        temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p, min_p=min_p
    )


Sampling = float | TokenDistribution
"""A sampling temperature (no truncation), or the whole `TokenDistribution`."""


def as_distribution(sampling: Sampling) -> TokenDistribution:
    return sampling if isinstance(sampling, TokenDistribution) else TokenDistribution(float(sampling))


@torch.no_grad()
def support_mask(logits: Tensor, dist: TokenDistribution) -> Tensor:
    """Bool `[..., V]`: the tokens vLLM could sample from temperature-scaled float32 `logits`."""
    shape = logits.shape
    x = logits.detach().float().reshape(-1, shape[-1]).clone()
    vocab = x.shape[-1]
    neg_inf = float("-inf")
    if dist.min_p > 0:
        probs = x.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(dist.min_p, dtype=torch.float32)
        x.masked_fill_(probs < threshold, neg_inf)
    k = dist.top_k if 0 < dist.top_k < vocab else None
    if dist.top_p < 1:
        ordered, order = x.sort(dim=-1, descending=False)
        if k is not None:
            kth = ordered[:, vocab - k].unsqueeze(-1)
            ordered.masked_fill_(ordered < kth, neg_inf)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= 1 - torch.tensor(dist.top_p, dtype=torch.float32)
        cut[:, -1] = False  # the most likely token always stays
        ordered.masked_fill_(cut, neg_inf)
        x = x.scatter(-1, order, ordered)
    elif k is not None:
        kth = x.topk(k, dim=-1).values[:, -1:]
        x.masked_fill_(x < kth, neg_inf)
    return (x > neg_inf).reshape(shape)


def token_logprobs(
    logits: Tensor, targets: Tensor, sampling: Sampling = 1.0, rows: Tensor | None = None
) -> Tensor:
    """Logprobs of `targets` under the processed distribution of `logits` (see the module docstring).

    `logits` is `[..., V]` and `targets` `[...]`: the sampled token at each position, always in the
    support. With `rows`, `logits` is `[N, V]` and `targets` `[M]` is scored at row `rows[m]` (prefix
    sharing scores several tokens at one position). `targets` may also be `[..., K]` (K tokens at
    each position, no `rows`): those outside the support get -inf. Without truncation this is
    ``log_softmax(logits / T)[target]``.
    """
    dist = as_distribution(sampling)
    logits = logits.float()
    if dist.temperature != 1.0:
        logits = logits / dist.temperature
    if rows is None and targets.dim() == logits.dim():  # K tokens per position
        if dist.truncates:
            logits = logits.masked_fill(~support_mask(logits, dist), float("-inf"))
        return logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)
    flat = logits.reshape(-1, logits.shape[-1])
    tokens = targets.reshape(-1)
    if rows is None:
        rows = torch.arange(tokens.numel(), device=flat.device)
    picked = flat[rows, tokens]
    if not dist.truncates:
        return (picked - torch.logsumexp(flat, dim=-1)[rows]).reshape(targets.shape)
    keep = support_mask(flat, dist)
    norm = torch.logsumexp(flat.masked_fill(~keep, float("-inf")), dim=-1)[rows]
    # a sampled token outside the recomputed support joins it (the engine's support held it)
    norm = torch.where(keep[rows, tokens], norm, torch.logaddexp(norm, picked))
    return (picked - norm).reshape(targets.shape)


def logprobs_with_full(
    logits: Tensor, targets: Tensor, sampling: Sampling, rows: Tensor | None = None
) -> Tensor:
    """`[..., 2]`: the processed logprobs of `targets` (`token_logprobs`) and their logprobs under
    the full distribution at the same temperature, from one set of logits."""
    dist = as_distribution(sampling)
    processed = token_logprobs(logits, targets, dist, rows)
    full = token_logprobs(logits, targets, dist.full(), rows) if dist.truncates else processed
    return torch.stack([processed, full], dim=-1)


__all__ = [
    "Sampling",
    "TokenDistribution",
    "as_distribution",
    "logprobs_with_full",
    "support_mask",
    "token_logprobs",
]
