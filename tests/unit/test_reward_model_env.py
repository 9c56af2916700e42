"""The ``reward_model`` environment: a group's rollouts scored together by the reward model as its
chat template renders them (backend ``local``: the real model in this process), and its errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from skylift.envs import make_env
from skylift.envs.reward_model import RewardModelEnv, close_scorers, scorer_for


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    from skylift.models.reward_model import load_reward_model

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(3)
    load_reward_model(str(tiny_model_dir)).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_group_scores_are_the_models_scores_of_the_rendered_rollouts(reward_model_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    answers = ["4", "It is 5.", "four, I think"]
    group = [make_env("reward_model", path=str(reward_model_dir), backend="local") for _ in answers]
    for env, answer in zip(group, answers, strict=True):
        env.init(prompt, {})
        result = env.step(answer)
        assert result.done and result.reward == 0.0
    scored = asyncio.run(group[0].finish_group(group, [None] * len(group)))
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    expected = []
    for answer in answers:
        ids = tok.apply_chat_template(
            [*prompt, {"role": "assistant", "content": answer}], tokenize=True, return_dict=False
        )
        with torch.no_grad():
            expected.append(float(hf(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert [s for s, _ in scored] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3  # the scores tell the responses apart
    assert scored[1][1] == {"reward_model_score": scored[1][0]}
    assert scorer_for(str(reward_model_dir), "local") is scorer_for(str(reward_model_dir), "local")
    close_scorers()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "set environment.env_kwargs.path"),
        ({"path": "x", "backend": "gpu"}, "backend='gpu' is not one of actor, local, vllm"),
        ({"path": "x", "model": "y"}, r"unknown environment.env_kwargs \['model'\]"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardModelEnv(**kwargs)
