"""Per-token log-probabilities of response tokens under a causal LM.

GRPO samples several responses per prompt, so a micro-batch usually holds a few distinct prompts,
each repeated. `response_logprobs` runs each distinct prompt once, expands its key/value cache to
the rows that share it, and runs only the response tokens per row. The result and its gradient
are those of the plain full-sequence forward (the cache expansion is an index: gradients of the
repeated rows add up), at a fraction of the compute when prompts are long.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skylift.algorithms.sample_support import Sampling, logprobs_with_full, token_logprobs
from skylift.worker.batch import SequenceBatch
from skylift.worker.vision_inputs import has_images, vision_kwargs, with_sampling_bias


def unique_prompts(batch: SequenceBatch) -> tuple[Tensor, Tensor]:
    """(index of one row per distinct prompt, for every row the position of its prompt in that index)."""
    prompt = torch.cat(
        [batch.input_ids[:, : batch.prompt_len], batch.attention_mask[:, : batch.prompt_len]], dim=1
    )
    _, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long)
    for row in range(batch.batch_size - 1, -1, -1):
        first[inverse[row]] = row
    return first, inverse


def response_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: Sampling = 1.0,
    share_prompts: bool = True,
    with_full: bool = False,
) -> Tensor:
    """Logprobs `[B, R]` of `batch.response_ids` given everything before them.

    `temperature` is the sampling temperature, or the whole `TokenDistribution` the engine sampled
    from (truncated sampling: skylift.algorithms.sample_support), so that the logprobs are those of
    the distribution the tokens were drawn from. `with_full` adds a last dimension: (those logprobs,
    the untruncated distribution's at the same temperature).
    Only response positions get logits (`logits_to_keep`). With `share_prompts`, rows that share a
    prompt share one prompt forward pass (see the module docstring). An extra ``target_ids``
    (`[B, R]` or `[B, R, K]`, long) scores those tokens at each response position instead of the
    response tokens themselves (the result is then `[B, R]` or `[B, R, K]`).
    """
    # transformers turns the KV cache off under gradient checkpointing while training
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False)) and model.training
    share = share_prompts and batch.response_len > 1 and not checkpointing and batch.row_inputs is None
    first, inverse = unique_prompts(batch) if share else (None, None)
    if first is None or len(first) == batch.batch_size:
        logits = _full_forward(model, batch)
    else:
        logits = _shared_prompt_forward(model, batch, first, inverse)
    score = logprobs_with_full if with_full else token_logprobs
    return score(logits, batch.extras.get("target_ids", batch.response_ids), temperature)


def _full_forward(model: torch.nn.Module, batch: SequenceBatch) -> Tensor:
    kwargs: dict[str, Tensor] = {"position_ids": batch.position_ids}
    if has_images(batch):  # (a row's routed experts are replayed around the forward, not passed)
        kwargs = vision_kwargs(model, batch)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        use_cache=False,
        logits_to_keep=batch.response_len + 1,
        **kwargs,
    )
    return with_sampling_bias(model, out.logits[:, :-1, :])


def _shared_prompt_forward(
    model: torch.nn.Module, batch: SequenceBatch, first: Tensor, inverse: Tensor
) -> Tensor:
    from transformers import DynamicCache

    p = batch.prompt_len
    positions = batch.position_ids
    prompt_out = model(
        input_ids=batch.input_ids[first, :p],
        attention_mask=batch.attention_mask[first, :p],
        position_ids=positions[first, :p],
        use_cache=True,
        past_key_values=DynamicCache(config=getattr(model, "config", None)),
        logits_to_keep=1,
    )
    cache = prompt_out.past_key_values
    cache.batch_select_indices(inverse)  # differentiable: prompt rows repeated per response
    last_prompt_logits = prompt_out.logits[inverse]  # [B, 1, V]: predicts the first response token
    end = batch.input_ids.shape[1] - 1  # the last response token predicts nothing we score
    resp_out = model(
        input_ids=batch.input_ids[:, p:end],
        attention_mask=batch.attention_mask[:, :end],
        position_ids=positions[:, p:end],
        past_key_values=cache,
        use_cache=True,
    )
    return with_sampling_bias(model, torch.cat([last_prompt_logits, resp_out.logits], dim=1))


def response_values(model: torch.nn.Module, batch: SequenceBatch) -> Tensor:
    """A value model's estimate `[B, R]` for each response token: V(state before the token), read
    at the position whose logits would predict it (the same positions `response_logprobs` scores).
    `model` is a transformers *ForTokenClassification model with one label."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    start = batch.prompt_len - 1
    return out.logits[:, start : start + batch.response_len, 0].float()
