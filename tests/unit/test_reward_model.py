"""Reward-model training's parts: the Bradley-Terry loss, the scalar head on the last non-pad token,
TRL-format rows and their errors, the configuration's checks, and an export that transformers'
`AutoModelForSequenceClassification` loads with our scores."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from skylift.algorithms.reward_model import bradley_terry_loss, pair_losses
from skylift.config.errors import ConfigError
from skylift.config.sft import load_sft_config
from skylift.models.reward_model import load_reward_model, right_padded, score_rows, sequence_rewards
from skylift.supervised.preference import PreferenceDataError
from skylift.supervised.reward import as_pairs, reward_row_of
from skylift.worker.reward_head import RewardPairs, RewardWorker
from skylift.worker.training_worker import WorkerSettings


def test_bradley_terry_loss_margin_and_centring() -> None:
    chosen, rejected = torch.tensor([1.0, 0.5, -2.0]), torch.tensor([0.0, 0.5, 1.0])
    assert float(bradley_terry_loss(torch.zeros(3), torch.zeros(3))) == pytest.approx(math.log(2))
    expected = [
        math.log1p(math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)
    ]
    assert pair_losses(chosen, rejected).tolist() == pytest.approx(expected, abs=1e-6)
    margin = torch.tensor([1.0, 0.0, 0.0])
    assert float(pair_losses(chosen, rejected, margin)[0]) == pytest.approx(math.log(2))
    centred = pair_losses(chosen, rejected, None, 0.01)
    sums = (chosen + rejected) ** 2
    assert centred.tolist() == pytest.approx((torch.tensor(expected) + 0.01 * sums).tolist(), abs=1e-6)
    # d loss / d chosen = -sigmoid(-(c - r)) / n: the mean over pairs
    c = chosen.clone().requires_grad_(True)
    bradley_terry_loss(c, rejected).backward()
    assert c.grad is not None
    assert c.grad.tolist() == pytest.approx((-torch.sigmoid(rejected - chosen) / 3).tolist(), abs=1e-6)


def test_head_reads_the_last_non_pad_token(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model = load_reward_model(str(tiny_model_dir))
    pad = int(model.config.pad_token_id)
    assert model.config.num_labels == 1
    rows = [[5, 6, 7, 8], [5, 6]]
    ids, mask = right_padded(rows, pad)
    assert ids[1].tolist() == [5, 6, pad, pad] and mask[1].tolist() == [1, 1, 0, 0]
    with torch.no_grad():
        batched = sequence_rewards(model, ids, mask)
        hidden = model.model(input_ids=torch.tensor([[5, 6]])).last_hidden_state[0, -1]
        alone = float(model.score(hidden)[0])
    # the head is Linear(hidden, 1) on the last real token's hidden state; padding changes nothing
    assert float(batched[1]) == pytest.approx(alone, abs=1e-5)
    assert score_rows(model, [rows[1]]) == pytest.approx([float(batched[1])], abs=1e-5)


def test_trl_rows_conversational_plain_and_margin(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    user = [{"role": "user", "content": "Hi"}]
    good, bad = [{"role": "assistant", "content": "Hello"}], [{"role": "assistant", "content": "Go away"}]
    explicit = reward_row_of({"prompt": user, "chosen": good, "rejected": bad, "margin": 2}, tok)
    implicit = reward_row_of({"chosen": user + good, "rejected": user + bad}, tok)
    assert (
        explicit.chosen
        == implicit.chosen
        == tok.apply_chat_template(user + good, tokenize=True, return_dict=False)
    )
    assert explicit.margin == 2.0 and implicit.margin is None
    text = reward_row_of({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, tok)
    assert tok.decode(text.chosen) == "2+2=4" + tok.eos_token
    pairs = as_pairs([explicit, implicit])
    assert pairs.margins == [2.0, 0.0] and as_pairs([implicit]).margins is None


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "row 3: a reward-model row needs 'chosen' and 'rejected'",
        ),
        ({"chosen": "a", "rejected": "b", "margin": "big"}, "row 3: 'margin' must be a number"),
        (
            {"chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
            "row 3: prompt, chosen and rejected",
        ),
    ],
)
def test_bad_rows_name_the_row(tiny_model_dir: Path, row: dict, message: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(PreferenceDataError, match=message):
        reward_row_of(row, tok, where="row 3")


def test_config_checks_for_reward_objective() -> None:
    ok = load_sft_config(["objective=reward", "train_datasets=[p.jsonl]", "center_rewards_coefficient=0.01"])
    assert ok.objective == "reward" and ok.center_rewards_coefficient == 0.01
    with pytest.raises(ConfigError, match="batch_size=3 pairs must split evenly over the 2 ranks"):
        load_sft_config(
            ["objective=reward", "train_datasets=[p.jsonl]", "batch_size=3", "placement.num_gpus_per_node=2"]
        )
    with pytest.raises(ConfigError, match="unset max_tokens_per_microbatch"):
        load_sft_config(["objective=reward", "train_datasets=[p.jsonl]", "max_tokens_per_microbatch=64"])


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_export_loads_as_sequence_classification_with_our_scores(
    tiny_model_dir: Path, tmp_path: Path, lora_rank: int
) -> None:
    """Full fine-tuning, and LoRA (adapters merged; the head trained whole)."""
    from transformers import AutoModelForSequenceClassification

    settings = WorkerSettings(model_path=str(tiny_model_dir), lora_rank=lora_rank)
    settings.optimizer.lr = 1e-2
    worker = RewardWorker(settings)
    worker.setup()
    pairs = RewardPairs([[5, 6, 7, 8, 9], [10, 11]], [[5, 6, 7], [12, 13, 14, 15]], [0.5, 0.0])
    first = worker.train_pairs(pairs, total_pairs=2, micro_pairs=1)
    second = worker.train_pairs(pairs, total_pairs=2, micro_pairs=2)
    assert second["loss_sum"] < first["loss_sum"]
    ours = worker.score_pairs(pairs, micro_pairs=2)
    path = worker.export_hf(str(tmp_path / "rm"))
    assert path is not None
    hf = AutoModelForSequenceClassification.from_pretrained(path)
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen2ForSequenceClassification"]
    ids, mask = right_padded(pairs.chosen + pairs.rejected, int(hf.config.pad_token_id))
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
    assert theirs == pytest.approx(ours[0] + ours[1], abs=1e-5)


def test_cli_names_a_dataset_without_pairs(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from skylift.cli import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    code = main(
        [
            "sft",
            "objective=reward",
            f"model.path={tiny_model_dir}",
            f"train_datasets=[{chats}]",
            f"runs_dir={tmp_path}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (
        f"skylift sft: {chats} row 0: a reward-model row needs 'chosen' and 'rejected' columns (found ['messages'])"
    )
