"""Rollouts through a real server: exact tokens and logprobs, rewards, multi-turn loss masks."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from skylift.data import PromptDataset, write_arithmetic_dataset
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.generator import rollout_seed
from skylift.inference.remote import RemoteInferenceEngine
from skylift.inference.types import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("arith_gen")
    write_arithmetic_dataset(out, num_train=4, num_val=1, seed=1)
    return list(PromptDataset(out / "train.parquet"))


def test_single_turn_batch(rows: list, tiny_model_dir: Path, tiny_server_url: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine(tiny_server_url)
    gen = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=12))
    params = SamplingParams(temperature=1.0, max_tokens=50, seed=3)
    trajectories = asyncio.run(gen.generate(rows, n=3, params=params, policy_version=7))
    assert len(trajectories) == 12
    assert [t.uid for t in trajectories] == [r.uid for r in rows for _ in range(3)]
    for t in trajectories:
        assert 0 < len(t.response_ids) <= 12  # max_generate_length caps the request's max_tokens
        assert len(t.rollout_logprobs) == len(t.response_ids) == len(t.loss_mask)
        assert all(lp <= 0.0 for lp in t.rollout_logprobs)
        assert t.reward in (0.0, 1.0)
        assert t.policy_version == 7
        assert t.prompt_ids == gen.encode_prompt(rows[[r.uid for r in rows].index(t.uid)].prompt)


def test_multi_turn_masks_observations(rows: list, tiny_model_dir: Path, tiny_server_url: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine(tiny_server_url)
    multi = [dataclasses.replace(r, env_class="arithmetic_multiturn") for r in rows]
    gen = Generator(
        engine, tokenizer, GeneratorSettings(max_generate_length=8, max_turns=2, env_kwargs={"max_turns": 2})
    )
    # the tiny model never answers right: every trajectory gets feedback and a second turn
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    trajectories = asyncio.run(gen.generate(multi, n=2, params=params))
    feedback = tokenizer.encode("Incorrect, try again.")
    for t in trajectories:
        assert t.reward == 0.0
        assert t.num_turns == 2
        masked = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
        assert masked, "observation tokens must be masked out of the loss"
        assert all(tok in masked for tok in feedback)
        assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if m == 0)
        assert sum(t.loss_mask) <= 16
        # between the turns, the template's tokens: the rest of the turn's end ("\n" after a sampled
        # <|im_end|>, all of "<|im_end|>\n" after a truncated turn), the feedback, the next header
        observation = "\n<|im_start|>user\nIncorrect, try again.<|im_end|>\n<|im_start|>assistant\n"
        first_turn = t.loss_mask.index(0)
        between = tokenizer.decode(masked)
        if t.response_ids[first_turn - 1] == tokenizer.eos_token_id:
            assert between == observation
        else:
            assert between == "<|im_end|>" + observation
        assert [r for _, r in t.turn_rewards] == [0.0, 0.0]


def test_seeded_rollouts_repeat_whatever_the_batching(
    rows: list, tiny_model_dir: Path, tiny_server_url: str
) -> None:
    """Per-prompt seeds: a prompt's samples depend on its seed only, not on its batch or engine."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen = Generator(
        RemoteInferenceEngine(tiny_server_url), tokenizer, GeneratorSettings(max_generate_length=24)
    )
    params = SamplingParams(temperature=1.0, max_tokens=24)
    seeds = [rollout_seed(42, 3, r.uid) for r in rows]
    assert len(set(seeds)) == len(seeds)

    def responses(batch: list, batch_seeds: list[int] | None) -> list[list[int]]:
        return [
            t.response_ids for t in asyncio.run(gen.generate(batch, n=3, params=params, seeds=batch_seeds))
        ]

    full = responses(rows, seeds)
    assert responses(rows, seeds) == full
    assert responses(rows[2:], seeds[2:]) == full[6:]  # alone or in a batch: the same samples
    assert len({tuple(r) for r in full[:3]}) > 1  # the samples of one prompt still differ
    assert responses(rows, [s + 1000 for s in seeds]) != full
    with pytest.raises(ValueError, match="2 seeds for 4 rows"):
        asyncio.run(gen.generate(rows, n=1, params=params, seeds=seeds[:2]))
