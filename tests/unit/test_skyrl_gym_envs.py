"""SkyRL-Gym environments in skylift: a ``BaseTextEnv`` subclass named as ``module:Class`` or by
its registered id, driven by skylift's generator with a fake engine (no vLLM)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip(
    "skyrl_gym", reason="skyrl-gym is a dependency of skylift (pyproject); not installed here"
)

from skylift.data import PromptSample  # noqa: E402
from skylift.envs import make_env  # noqa: E402
from skylift.envs.skyrl_gym import SkyRLGymEnv, configure  # noqa: E402
from skylift.generator import Generator, GeneratorSettings  # noqa: E402
from skylift.inference.types import Completion, GenerateOutput, SamplingParams  # noqa: E402

CLASS = "skyrl_gym_example_env:MultiplyEnv"
EXTRAS = {"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {}, "data_source": "t"}


@pytest.fixture(autouse=True)
def _run_config():
    configure({"skylift_test_multiply": {"bonus": 0.5}}, max_turns=2)
    yield
    configure({}, max_turns=1)


def test_module_class_and_registered_id_build_the_env_as_skyrl_does() -> None:
    env = make_env(CLASS)  # importing the module registers its id too
    assert isinstance(env, SkyRLGymEnv)
    prompt = env.init([{"role": "user", "content": "6 * 7?"}], EXTRAS)
    assert prompt == [{"role": "user", "content": "6 * 7?"}]
    first = env.step("it is 41")
    assert not first.done and first.observations == [{"role": "user", "content": "Wrong, try again."}]
    assert first.metadata["postprocessed_action"] == "it is 41"
    last = env.step("42")
    assert last.done and last.reward == 1.5  # env_config from environment.skyrl_gym.<id>
    assert last.metadata == {"correct": True, "env_metrics": {"turns": 2}}
    env.close()
    by_id = make_env("skylift_test_multiply", bonus=0.25)  # environment.env_kwargs win
    by_id.init([{"role": "user", "content": "6 * 7?"}], EXTRAS)
    assert by_id.step("42").reward == 1.25


def test_skyrl_gyms_builtins_resolve_by_name_and_skylifts_own_names_win() -> None:
    from skylift.envs.gsm8k import GSM8KEnv

    assert isinstance(make_env("gsm8k"), GSM8KEnv)  # skylift's gsm8k
    env = make_env("gsm8k_multi_turn")  # SkyRL-Gym's
    assert isinstance(env, SkyRLGymEnv)
    skyrl_gsm8k = make_env("skyrl_gym.envs.gsm8k.env:GSM8kEnv")
    skyrl_gsm8k.init([{"role": "user", "content": "q"}], {**EXTRAS, "reward_spec": {"ground_truth": "3"}})
    assert skyrl_gsm8k.step("#### 3").reward == 1.0
    with pytest.raises(ValueError, match="cannot import Nope"):
        make_env("skyrl_gym_example_env:Nope")


class FakeEngine:
    """Answers each request with the next scripted reply, tokenised."""

    def __init__(self, tokenizer, replies: list[str]) -> None:  # noqa: ANN001
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, prompts, params: SamplingParams, session_id=None):  # noqa: ANN001
        self.prompts.extend(prompts)
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
            comps = [Completion(token_ids=ids, logprobs=[-0.1] * len(ids), stop_reason="stop")] * params.n
            out.append(GenerateOutput(prompt_token_ids=p, completions=comps))
        return out


def test_the_generator_rolls_out_a_multi_turn_skyrl_gym_env(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = FakeEngine(tokenizer, ["41", "42"])
    row = PromptSample(
        prompt=[{"role": "user", "content": "6 * 7?"}],
        env_class="skylift_test_multiply",
        reward_spec=EXTRAS["reward_spec"],
        extra_info={},
        data_source="t",
        uid="0:0",
    )
    configure({"skylift_test_multiply": {"bonus": 0.5}}, 2, ["skyrl_gym_example_env"])
    settings = GeneratorSettings(max_generate_length=8, max_turns=2, batched=False)
    gen = Generator(engine, tokenizer, settings)
    (traj,) = asyncio.run(gen.generate([row], 1, SamplingParams(max_tokens=8)))
    assert traj.reward == 1.5 and traj.num_turns == 2
    assert traj.env_class == "skylift_test_multiply"  # what the per-environment metrics group by
    assert traj.env_metadata["env_metrics"] == {"turns": 2}
    first = tokenizer.encode("41", add_special_tokens=False)
    assert traj.response_ids[: len(first)] == first
    assert 0 in traj.loss_mask and traj.loss_mask[0] == 1 and traj.loss_mask[-1] == 1  # observation masked


def test_import_modules_must_exist() -> None:
    with pytest.raises(ValueError, match="environment.import_modules: cannot import 'no_such_module_x'"):
        configure({}, 1, ["no_such_module_x"])
