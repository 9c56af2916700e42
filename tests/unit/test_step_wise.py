"""Step-wise trajectories (`generator.step_wise_trajectories`): each turn its own sample, its prompt
the conversation as the template renders it for that turn, every step sharing the rollout's
advantage. With a template that drops past thinking (as Qwen3's) the second turn's context is the
template's only with them; the trainer gives each rollout's last-step GRPO advantage to all its steps."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer
from rl_fakes import FakeGenerator, fake_run

from skylift.algorithms import compute_advantages
from skylift.config import ConfigError, load_config
from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.generator import Generator, GeneratorSettings, Trajectory
from skylift.inference.types import SamplingParams
from skylift.rl.experience import ExperienceStages, make_experience
from skylift.rl.step_wise import check_step_wise, step_wise_advantages

#: ChatML that drops the thinking of every assistant turn but the last, as Qwen3's template does.
DROPS_THINKING = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and not loop.last %}"
    "{{ message.content.split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CONVERSATION = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhi"},
    {"role": "user", "content": "Again."},
]


class AskTwice(Environment):
    """Turn 1: reward 0.5 and "Again."; turn 2: reward 1, done."""

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        if turn == 1:
            return StepResult([{"role": "user", "content": "Again."}], 0.5, False)
        self.done = True
        return StepResult([], 1.0, True, {"last": action}, {"turns_seen": 2.0})


@pytest.fixture(autouse=True)
def _env() -> Any:
    register_env("ask_twice")(AskTwice)
    yield
    unregister_env("ask_twice")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer(DROPS_THINKING)


def _turn(tokenizer: Any, text: str) -> Reply:
    return Reply(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])


def _run(tokenizer: Any, step_wise: bool, merge: bool = False) -> tuple[list[Trajectory], ScriptedEngine]:
    replies = [_turn(tokenizer, "<think>\nhm\n</think>\n\nhi"), _turn(tokenizer, "hello")]
    engine = ScriptedEngine(replies)
    settings = GeneratorSettings(
        max_generate_length=32, max_turns=3, batched=False, step_wise=step_wise, merge_steps=merge
    )
    row = Row(prompt=[{"role": "user", "content": "Say hi."}], env_class="ask_twice")
    out = asyncio.run(
        Generator(engine, tokenizer, settings).generate([row], 1, SamplingParams(max_tokens=32))
    )
    return out, engine


def test_without_step_wise_the_dropped_thinking_stops_the_rollout(tokenizer: Any) -> None:
    # one sequence cannot hold both the sampled thinking and the template's rendering without it
    from skylift.generator.chat import TemplateMismatch

    with pytest.raises(TemplateMismatch, match="trajectory has '<think>.*on_template_mismatch=step_wise"):
        _run(tokenizer, step_wise=False)


def test_each_turn_is_a_sample_whose_prompt_is_the_rendered_conversation(tokenizer: Any) -> None:
    out, engine = _run(tokenizer, step_wise=True)
    first, second = out
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert "hm" not in tokenizer.decode(rendered)  # the past thinking is gone, as the template wants
    assert second.prompt_ids == list(rendered) == engine.prompts[1]
    assert first.prompt_ids == engine.prompts[0]
    assert first.response_ids == tokenizer.encode("<think>\nhm\n</think>\n\nhi", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert second.response_ids == tokenizer.encode("hello", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert all(tr.loss_mask == [1] * len(tr.response_ids) for tr in out)
    assert [tr.reward for tr in out] == [1.5, 1.5]  # every step carries the rollout's reward
    assert first.trajectory_id == second.trajectory_id is not None
    assert [tr.last_step for tr in out] == [False, True]
    assert (first.env_metadata, second.env_metadata) == ({}, {"last": "hello"})
    assert (first.metrics, second.metrics) == ({}, {"turns_seen": 2.0})
    assert [tr.turn_rewards for tr in out] == [[], []]


def _step(uid: str, rollout: str, last: bool, reward: float, length: int = 2) -> Trajectory:
    return Trajectory(
        uid=uid,
        prompt_ids=[5, 6],
        response_ids=[7] * length,
        loss_mask=[1] * length,
        rollout_logprobs=[-1.0] * length,
        reward=reward,
        stop_reason="stop",
        trajectory_id=rollout,
        last_step=last,
    )


def test_every_step_gets_its_rollouts_last_step_grpo_advantage() -> None:
    # prompt a: rollout a1 (3 steps, reward 1), a2 (1 step, reward 0); prompt b: b1 (2 steps, 2), b2 (1, 0)
    batch = [
        _step("a", "a1", False, 1.0),
        _step("a", "a1", False, 1.0, 3),
        _step("a", "a1", True, 1.0),
        _step("a", "a2", True, 0.0),
        _step("b", "b1", False, 2.0),
        _step("b", "b1", True, 2.0),
        _step("b", "b2", True, 0.0, 1),
    ]
    exp = make_experience(batch, ExperienceStages.of(), policy_version=0)
    advantages, mask = exp.batch.extras["advantages"], exp.batch.response_mask
    last = torch.tensor([[1.0, 0.0, 2.0, 0.0]])[0]
    reference, _ = compute_advantages("grpo", last, torch.ones(4, 1), group_ids=["a", "a", "b", "b"])
    per_rollout = dict(zip(["a1", "a2", "b1", "b2"], reference[:, 0].tolist(), strict=True))
    for row, tr in enumerate(batch):
        expected = per_rollout[tr.trajectory_id or ""]
        valid = mask[row] != 0
        assert torch.allclose(advantages[row][valid], torch.full((int(valid.sum()),), expected))
        assert float(advantages[row][~valid].abs().sum()) == 0.0
    assert per_rollout["a1"] > 0 > per_rollout["a2"]  # the steps of the better rollout are pushed up


def test_a_rollout_without_its_last_step_and_per_token_estimators_are_refused() -> None:
    with pytest.raises(ValueError, match="without their last step"):
        step_wise_advantages("grpo", torch.ones(1), torch.ones(1, 2), [_step("a", "a1", False, 1.0)], True)
    with pytest.raises(ValueError, match="sequence-level advantage estimator"):
        check_step_wise("gae", False)
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        check_step_wise("grpo", True)


def test_the_config_key_is_live() -> None:
    cfg = load_config(
        ["generator.step_wise_trajectories=true", "generator.batched=false", "generator.max_turns=2"]
    )
    from skylift.cluster.settings import generator_settings

    assert generator_settings(cfg).step_wise is True and generator_settings(cfg).merge_steps is False
    merged = load_config(
        [*(f"{k}={v}" for k, v in _STEP_WISE.items()), "generator.merge_stepwise_output=true"]
    )
    assert generator_settings(merged).merge_steps is True
    with pytest.raises(
        ConfigError, match="merge_stepwise_output=true needs generator.step_wise_trajectories"
    ):
        load_config(["generator.merge_stepwise_output=true"])


_STEP_WISE = {
    "generator.step_wise_trajectories": "true",
    "generator.batched": "false",
    "generator.max_turns": "2",
}


def test_merged_steps_of_a_template_that_keeps_history_are_the_whole_rollout() -> None:
    """SkyRL's merge_stepwise_output: ChatML renders history unchanged, so each step extends the one
    before and the merged sample is exactly the rollout's one trajectory without step-wise."""
    tokenizer = chatml_tokenizer()
    (whole,), _ = _run(tokenizer, step_wise=False)
    (merged,), _ = _run(tokenizer, step_wise=True, merge=True)
    assert (merged.prompt_ids, merged.response_ids) == (whole.prompt_ids, whole.response_ids)
    assert merged.loss_mask == whole.loss_mask and 0 in merged.loss_mask  # the observation: untrained
    assert merged.rollout_logprobs == whole.rollout_logprobs
    assert merged.last_step and merged.trajectory_id is not None and merged.reward == whole.reward == 1.5
    assert merged.env_metadata == {"last": "hello"}


def test_steps_of_a_template_that_rewrites_history_stay_apart(tokenizer: Any) -> None:
    out, _ = _run(tokenizer, step_wise=True, merge=True)  # the second prompt drops the first's thinking
    unmerged, _ = _run(tokenizer, step_wise=True)
    assert [(tr.prompt_ids, tr.response_ids, tr.last_step) for tr in out] == [
        (tr.prompt_ids, tr.response_ids, tr.last_step) for tr in unmerged
    ]


def test_merging_is_greedy_and_keeps_versions() -> None:
    from skylift.generator.step_wise import merge_steps

    def step(prompt: list[int], response: list[int], version: int, last: bool = False) -> Trajectory:
        return Trajectory(
            "u",
            prompt,
            response,
            [1] * len(response),
            [-0.5] * len(response),
            1.0,
            "stop",
            policy_version=version,
            token_versions=[version] * len(response),
            trajectory_id="r",
            last_step=last,
        )

    steps = [
        step([1, 2], [3], 0),
        step([1, 2, 3, 9], [4], 1),
        step([7], [8], 1),
        step([7, 8, 6], [5], 2, True),
    ]
    first, second = merge_steps(steps)
    assert (first.prompt_ids, first.response_ids, first.loss_mask) == ([1, 2], [3, 9, 4], [1, 0, 1])
    assert first.rollout_logprobs == [-0.5, 0.0, -0.5] and first.token_versions == [0, 0, 1]
    assert (first.policy_version, first.last_step) == (0, False)
    assert (second.prompt_ids, second.response_ids, second.token_versions) == ([7], [8, 6, 5], [1, 1, 2])
    assert second.last_step and second.policy_version == 1


class StepWiseFake(FakeGenerator):
    """The fake generator's rollouts, each cut into two step-wise samples."""

    async def generate(
        self, rows: Any, n: int, params: Any, policy_version: int = 0, seeds: Any = None
    ) -> Any:
        out = []
        for k, tr in enumerate(await super().generate(rows, n, params, policy_version, seeds)):
            first = dataclasses.replace(tr, trajectory_id=f"r{k}", last_step=False)
            out += [first, dataclasses.replace(tr, trajectory_id=f"r{k}", last_step=True)]
        return out


def test_the_loop_trains_steps_in_as_many_mini_batches_as_rollouts_would_take(tmp_path: Path) -> None:
    # 4 prompts x 2 samples, mini-batches of 2 prompts: 2 optimizer steps of 4 rollouts = 8 samples
    run = fake_run(
        tmp_path, "trainer.policy_mini_batch_size=2", "trainer.max_steps=2", generator=StepWiseFake()
    )
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert [h["step"] for h in history] == [1, 2]
    assert [len(mini) for mini in run.policy.trained] == [8, 8, 8, 8]
    assert all(h["advantages/abs_mean"] > 0 for h in history)  # alternating rewards: a signal
