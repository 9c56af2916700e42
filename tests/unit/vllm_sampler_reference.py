"""vLLM's sampler transcribed one row at a time, the reference of the sampling-support tests:
temperature, min-p, top-k, top-p in that order, torch's ascending sort for top-p as vLLM's PyTorch
path does. tests/integration/test_server_sample_support.py checks skylift's batched code, which
agrees with this reference, against vLLM's own sampler functions."""

from __future__ import annotations

import torch

from skylift.algorithms.sample_support import TokenDistribution

NEG_INF = float("-inf")


def reference_logprobs(row: torch.Tensor, dist: TokenDistribution) -> torch.Tensor:
    """vLLM's processed logprobs of one row of logits, `[V]` (-inf outside the support)."""
    x = row.float() / dist.temperature
    vocab = x.numel()
    if dist.min_p > 0:
        probs = x.softmax(-1)
        threshold = float(probs.max()) * torch.tensor(dist.min_p, dtype=torch.float32)
        x = torch.where(probs < threshold, NEG_INF, x)
    k = dist.top_k if 0 < dist.top_k < vocab else None
    if dist.top_p < 1:  # one ascending sort serves top-k and top-p (vLLM's PyTorch path)
        ordered, order = x.sort(descending=False)
        if k is not None:
            kth = float(ordered[vocab - k])  # every logit tied with the k-th stays
            ordered = torch.where(ordered < kth, NEG_INF, ordered)
        cumulative = ordered.softmax(-1).cumsum(-1).tolist()
        limit = float(1 - torch.tensor(dist.top_p, dtype=torch.float32))
        cut = [i for i in range(vocab - 1) if cumulative[i] <= limit]  # the last token always stays
        ordered[cut] = NEG_INF
        x = torch.empty_like(x).scatter(0, order, ordered)
    elif k is not None:
        kth = sorted(x.tolist(), reverse=True)[k - 1]
        x = torch.where(x < kth, NEG_INF, x)
    return x.log_softmax(-1)
