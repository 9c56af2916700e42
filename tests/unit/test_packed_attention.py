"""A packed row's sequences attending one at a time (`skylift.worker.packed_attention`) give what the
row's block-diagonal mask gives, and a packed pass that scores the target tokens only
(`targets_only`) gives those tokens' logprobs and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tolerances import assert_gradients_close, assert_sums_close

from skylift.models.tiny_qwen2 import HIDDEN_SIZE, VOCAB_SIZE
from skylift.worker import packed_attention
from skylift.worker.batch import build_sequence_batch
from skylift.worker.micro_batches import pack, packed_response_logprobs
from skylift.worker.packed_attention import ATTENTION_NAME, sequence_attention


def _model(model_dir: Path, attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention
    )
    return model.eval()


def _batch():
    gen = torch.Generator().manual_seed(3)
    lengths = [(5, 9), (2, 1), (7, 4), (1, 12)]  # (prompt, response); one 2-token sequence
    prompts = [torch.randint(5, 500, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(5, 500, (r,), generator=gen).tolist() for _, r in lengths]
    masks = [[int(i % 3 != 1) for i in range(r)] for _, r in lengths]  # some response tokens untrained
    return build_sequence_batch(prompts, responses, masks, pad_token_id=0)


def test_sequence_attention_equals_the_block_diagonal_mask(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tiny_model_dir)
    layout = pack(_batch())
    assert sum(layout.lengths) < packed_attention.MIN_ROW_TOKENS
    with sequence_attention(model, layout.lengths):  # a short row keeps the masked SDPA call
        assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(packed_attention, "MIN_ROW_TOKENS", 0)
    inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids, "use_cache": False}
    with torch.no_grad():
        masked = model(**inputs).logits  # transformers' block-diagonal mask from the position ids
        with sequence_attention(model, layout.lengths):
            assert model.config._attn_implementation == ATTENTION_NAME
            per_sequence = model(**inputs).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    assert_sums_close(per_sequence, masked, HIDDEN_SIZE)
    # and not what attending across the row's sequences gives
    with torch.no_grad():
        model.config._attn_implementation = ATTENTION_NAME
        try:
            with sequence_attention(model, [sum(layout.lengths)]):
                pass  # the model is not on SDPA now: the context leaves it alone
            packed_attention._ACTIVE.append([sum(layout.lengths)])
            across = model(**inputs).logits
        finally:
            packed_attention._ACTIVE.pop()
            model.config._attn_implementation = "sdpa"
    assert (across - masked).abs().max() > 1e-2


def test_other_attention_implementations_are_left_alone(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir, attention="eager")
    with sequence_attention(model, [3, 4]):
        assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="only inside sequence_attention"):
        packed_attention._attention(model, *(torch.zeros(1, 2, 3, 4) for _ in range(3)), None)


def test_targets_only_scores_the_marked_tokens(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_attention, "MIN_ROW_TOKENS", 0)
    batch = _batch()
    mask = batch.response_mask.bool()
    results = []
    for targets_only in (False, True):
        model = _model(tiny_model_dir).train()
        logp = packed_response_logprobs(model, batch, targets_only=targets_only)
        (-(logp * mask).sum()).backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (every, every_grads), (targets, target_grads) = results
    assert (targets[~mask] == 0).all() and (every[~mask] != 0).any()
    assert_sums_close(targets[mask], every[mask], VOCAB_SIZE)
    assert_gradients_close(target_grads, every_grads, int(batch.attention_mask.sum()))


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "sliding-window"])
def test_attention_equals_sdpa_under_the_row_mask(window: int | None) -> None:
    """The attention function itself against SDPA under the whole row's mask: block-diagonal,
    causal, and with a sliding window at most `window - 1` tokens back (grouped-query: 4 query
    heads on 2 key/value heads)."""
    lengths = [5, 1, 7, 2]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, total, 8, generator=gen)
    k, v = (torch.randn(1, 2, total, 8, generator=gen) for _ in range(2))
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(total)
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    if window:
        mask &= pos[:, None] - pos[None, :] < window
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    packed_attention._ACTIVE.append(lengths)
    try:
        got, _ = packed_attention._attention(torch.nn.Module(), q, k, v, None, sliding_window=window)
    finally:
        packed_attention._ACTIVE.pop()
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
