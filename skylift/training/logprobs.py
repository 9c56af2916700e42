"""Per-token log-probabilities of response tokens under a causal LM."""

from __future__ import annotations

import torch
from torch import Tensor

from skylift.training.batch import SequenceBatch


def gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] without materialising the full log-softmax twice."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    logits = logits.float()
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def response_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs `[B, R]` of `batch.response_ids` given everything before them.

    Logits are divided by the sampling temperature so they match what the engine sampled from.
    Only the last R + 1 positions' logits are computed (`logits_to_keep`).
    """
    resp_len = batch.response_len
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=resp_len + 1,
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    logp = gather_logprobs(logits, batch.response_ids)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logp, entropy
