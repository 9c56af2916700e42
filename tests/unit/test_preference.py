"""Preference rows in TRL's formats and the DPO / IPO losses' values and derivatives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from skylift.supervised.preference import PreferenceDataError, dpo_loss, pair_batch, pair_of


def test_explicit_implicit_and_text_pairs(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    user = [{"role": "user", "content": "Hi"}]
    good, bad = [{"role": "assistant", "content": "Hello"}], [{"role": "assistant", "content": "Go away"}]
    explicit = pair_of({"prompt": user, "chosen": good, "rejected": bad}, tok)
    implicit = pair_of({"chosen": user + good, "rejected": user + bad}, tok)
    assert explicit == implicit
    assert tok.decode(explicit.chosen) == "Hello<|im_end|>\n"
    text = pair_of({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, tok)
    assert tok.decode(text.chosen) == "4" + tok.eos_token
    batch = pair_batch([explicit, text], 0)
    assert batch.batch_size == 4 and batch.response_mask.sum(-1).tolist() == [
        len(explicit.chosen),
        len(text.chosen),
        len(explicit.rejected),
        len(text.rejected),
    ]
    with pytest.raises(PreferenceDataError, match="row 3: a preference row needs 'chosen' and 'rejected'"):
        pair_of({"prompt": "x", "chosen": "y"}, tok, where="row 3")


def test_losses_start_at_their_reference_values_and_their_derivatives_are_autograds() -> None:
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])  # chosen 0, 1; rejected 0, 1
    loss, grad, metrics = dpo_loss(logps, logps.clone(), torch.ones(4), "sigmoid", 0.1)
    assert loss == pytest.approx(math.log(2)) and metrics["reward_margin"] == 0
    assert grad.tolist() == pytest.approx([-0.025, -0.025, 0.025, 0.025])  # -beta/2 * sigma(0) / 2 pairs
    ref = torch.tensor([-3.5, -5.0, -4.0, -2.5])
    lengths = torch.tensor([2.0, 4.0, 1.0, 2.0])
    loss, grad, _ = dpo_loss(logps, ref, lengths, "ipo", 0.5)
    x = logps.clone().requires_grad_(True)
    r = (x - ref) / lengths
    expected = ((r[:2] - r[2:] - 1.0) ** 2).mean()
    expected.backward()
    assert loss == pytest.approx(float(expected)) and grad.tolist() == pytest.approx(x.grad.tolist())
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'"):
        dpo_loss(logps, ref, lengths, "kto", 0.1)
