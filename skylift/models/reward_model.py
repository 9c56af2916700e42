"""Reward models: a causal LM's backbone with a scalar head on its last non-pad token.

A reward model is transformers' ``*ForSequenceClassification`` with ``num_labels=1``: the
backbone's hidden state at each row's last token that is not the padding token goes through
``score`` (``Linear(hidden, 1, bias=False)``). Using transformers' own class means a trained model
saves and loads as ``AutoModelForSequenceClassification`` (vLLM's pooling runner reads it too), and
scores here equal the ones anyone gets from the saved directory.

"Last non-pad token" is transformers' rule: the rightmost position whose id is not
``config.pad_token_id`` (so a row that ends in the padding id, e.g. an EOS used as padding, is read
at the token before it, as in TRL's `RewardTrainer`). Rows are right-padded with that id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from skylift.utils.dtypes import FLOAT_DTYPES, str_to_dtype


def load_reward_model(model_path: str, dtype: str = "float32") -> Any:
    """`model_path` (a causal LM or a saved reward model) as a ``*ForSequenceClassification`` with
    one label; a new head is initialised from torch's global seed (seed before calling). Its
    ``config.pad_token_id`` is set from the tokenizer (its pad token, else its EOS) when missing."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from skylift.models import resolve_model_path

    path = resolve_model_path(model_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized: ['score.weight']" is what we ask for
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=str_to_dtype(dtype, FLOAT_DTYPES)
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.num_labels != 1:
        raise ValueError(
            f"{model_path}: a reward model has one label, this one has {model.config.num_labels}"
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer_pad_id(path)
    return model


def tokenizer_pad_id(model_path: str) -> int:
    """The padding id a reward model of `model_path` uses: the tokenizer's pad token, else its EOS."""
    from transformers import AutoTokenizer

    from skylift.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model_path))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise ValueError(f"{model_path}: the tokenizer has neither a pad nor an EOS token to pad with")
    return int(pad)


def pad_id_of(model: Any) -> int:
    """The padding id of a loaded reward model (through a PEFT or FSDP wrapper too)."""
    config = model.config
    return int(config.pad_token_id)


def right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask) `[n, longest]` of token rows, right-padded with `pad_id`."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def sequence_rewards(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """One reward per row `[n]` (float32), differentiable (see the module docstring)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_rows(model: Any, rows: Sequence[Sequence[int]], batch_size: int = 8) -> list[float]:
    """Rewards of token rows, `batch_size` rows a forward pass (no gradient)."""
    if not rows:
        return []
    device = next(model.parameters()).device
    pad = pad_id_of(model)
    out: list[float] = []
    for i in range(0, len(rows), max(batch_size, 1)):
        ids, mask = right_padded(rows[i : i + batch_size], pad)
        out += sequence_rewards(model, ids.to(device), mask.to(device)).cpu().tolist()
    return out


__all__ = [
    "load_reward_model",
    "pad_id_of",
    "right_padded",
    "score_rows",
    "sequence_rewards",
    "tokenizer_pad_id",
]
