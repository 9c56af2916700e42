"""The reward model's vLLM pooling scorer (`skylift.inference.reward_pooling`, the ``reward_model``
environment's ``vllm`` backend) gives the scores the model gives in torch: the raw head output at
each row's last token (no sigmoid), for rows of different lengths in one call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from server_helpers import require_loopback_namespace

from skylift.inference.reward_pooling import VLLMPoolingScorer, make_pooling_scorer
from skylift.inference.reward_scoring import TorchModel

pytestmark = pytest.mark.integration


def test_pooling_scores_equal_the_torch_reward_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from skylift.models.reward_model import load_reward_model

    require_loopback_namespace()
    rm = tmp_path / "rm"
    torch.manual_seed(5)  # an untrained head: its raw scores spread around 0, some negative
    load_reward_model(str(tiny_model_dir)).save_pretrained(rm)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm)
    gen = torch.Generator().manual_seed(0)
    # ids from 5: never the padding id (0), where the torch path would read an earlier token
    rows = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 64, 1)]
    want = TorchModel(str(rm), batch_size=4).score_rows(rows)
    scorer = make_pooling_scorer(str(rm), "vllm", batch_size=4)
    assert isinstance(scorer, VLLMPoolingScorer)
    try:
        got = scorer.score_rows(rows)
    finally:
        scorer.close()
    assert got == pytest.approx(want, abs=1e-4)
    assert any(s < 0 for s in want)  # raw logits: a sigmoid would have made every score positive
    assert make_pooling_scorer(str(rm), "actor", batch_size=4) is None
