"""Preference pairs and the DPO / IPO losses of `skylift sft objective=dpo`.

Rows in TRL's preference format: ``prompt`` with ``chosen`` and ``rejected`` completions (lists of
messages, or strings), or ``chosen``/``rejected`` whole conversations whose shared first messages
are the prompt. A completion's tokens are what rendering prompt + completion adds after the
prompt with its generation prompt (TRL's tokenization; strings get the EOS appended).

The losses are TRL's, over pairs ``p`` with policy and reference completion logprobs summed
(``pc``, ``pr``; ``rc``, ``rr``) and ``z = (pc - rc) - (pr - rr)``:

- ``sigmoid`` (DPO): ``mean(-logsigmoid(beta * z))``, which is ln 2 while the policy is the reference;
- ``ipo``: ``mean((zbar - 1 / (2 beta))^2)`` with each sum divided by its completion's tokens.

A step first scores its pairs without gradient (the policy's logprobs, the reference's are
precomputed), which gives the loss and its derivative by each completion's logprob sum; the
training pass then backpropagates the supervised loss `cross_entropy` with those derivatives as the
per-token weights, whose gradient is the loss's (it is linear in the sums). So a pair may fall
across micro-batches and ranks, as any rows do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from skylift.algorithms.supervised import cross_entropy
from skylift.generator.chat import ChatFormat
from skylift.worker.batch import SequenceBatch, build_sequence_batch

DPO_LOSSES = ("sigmoid", "ipo")


class PreferenceDataError(ValueError):
    """A preference row has no prompt/chosen/rejected (the message names the row)."""


@dataclass(frozen=True)
class PairRow:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def preference_columns(
    row: dict[str, Any], where: str, kind: str = "a preference row"
) -> tuple[Any, Any, Any]:
    """A TRL-format preference row's ``prompt`` (None when absent), ``chosen`` and ``rejected``; a row
    without the last two raises naming `where` and what `kind` of row it is."""
    if "chosen" not in row or "rejected" not in row:
        raise PreferenceDataError(
            f"{where}: {kind} needs 'chosen' and 'rejected' columns (found {sorted(row)})"
        )
    return row.get("prompt"), row["chosen"], row["rejected"]


def ending_with_eos(completion: str, tokenizer: Any) -> str:
    """A string completion with the tokenizer's EOS text appended unless it ends with it (as TRL)."""
    eos = tokenizer.eos_token or ""
    return completion if completion.endswith(eos) else completion + eos


def pair_of(
    row: dict[str, Any], tokenizer: Any, template_kwargs: dict[str, Any] | None = None, where: str = "row"
) -> PairRow:
    """A TRL-format preference row tokenized (see the module docstring)."""
    prompt, chosen, rejected = preference_columns(row, where)
    if isinstance(chosen, str) and isinstance(rejected, str):
        p = list(tokenizer(prompt or "")["input_ids"])

        def text(completion: str) -> list[int]:
            ids = tokenizer((prompt or "") + ending_with_eos(completion, tokenizer))["input_ids"]
            return list(ids)[len(p) :]

        return PairRow(p, text(chosen), text(rejected))
    if prompt is None:  # implicit prompt: the messages both conversations start with
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    if (
        not (isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list))
        or not prompt
    ):
        raise PreferenceDataError(
            f"{where}: prompt, chosen and rejected must be message lists (or all strings)"
        )
    chat = ChatFormat(tokenizer, template_kwargs)
    tools = row.get("tools")
    p = chat.render(prompt, add_generation_prompt=True, tools=tools)
    return PairRow(
        p,
        chat.render([*prompt, *chosen], add_generation_prompt=False, tools=tools)[len(p) :],
        chat.render([*prompt, *rejected], add_generation_prompt=False, tools=tools)[len(p) :],
    )


def pair_batch(pairs: Sequence[PairRow], pad_token_id: int) -> SequenceBatch:
    """Rows ``[chosen_0 .. chosen_n-1, rejected_0 .. rejected_n-1]`` after their prompts."""
    return build_sequence_batch(
        [p.prompt for p in pairs] * 2,
        [p.chosen for p in pairs] + [p.rejected for p in pairs],
        pad_token_id=pad_token_id,
    )


def dpo_loss(
    logps: Tensor, ref_logps: Tensor, lengths: Tensor, loss_type: str, beta: float
) -> tuple[float, Tensor, dict[str, float]]:
    """(loss, d loss / d logps, metrics) of `2n` rows' completion logprob sums (chosen first)."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss {loss_type!r}; use one of {', '.join(DPO_LOSSES)}")
    x = logps.detach().double().requires_grad_(True)
    ratios = x - ref_logps.double()
    if loss_type == "ipo":
        ratios = ratios / lengths.double().clamp(min=1.0)
    chosen, rejected = ratios.chunk(2)
    z = chosen - rejected
    per_pair = (
        -torch.nn.functional.logsigmoid(beta * z) if loss_type == "sigmoid" else (z - 1 / (2 * beta)) ** 2
    )
    loss = per_pair.mean()
    (grad,) = torch.autograd.grad(loss, x)
    metrics = {
        "reward_margin": float(beta * z.detach().mean()),
        "reward_accuracy": float((z.detach() > 0).double().mean()),
    }
    return float(loss), grad.float(), metrics


@dataclass
class WeightedObjective:
    """``sum(cross_entropy(logp, mask, weights))`` with the batch's per-token ``weights`` extra: the
    surrogate whose gradient is the preference loss's (see the module docstring)."""

    totals: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __call__(self, logprobs: Tensor, micro: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.response_mask.to(logprobs.dtype)
        loss = cross_entropy(logprobs, mask, micro.extras["weights"].to(logprobs.dtype)).sum()
        self.totals[1] += float(mask.sum())
        return loss, {}


__all__ = ["DPO_LOSSES", "PairRow", "WeightedObjective", "dpo_loss", "pair_batch", "pair_of"]
