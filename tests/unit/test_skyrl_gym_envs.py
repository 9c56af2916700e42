"""SkyRL-Gym environments in skylift: a ``BaseTextEnv`` subclass named as ``module:Class`` or by
its registered id, driven by skylift's generator with a fake engine (no vLLM)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip(
    "skyrl_gym", reason="skyrl-gym is a dependency of skylift (pyproject); not installed here"
)

from skylift.compat.skyrl.gym import SkyRLGymEnv, configure  # noqa: E402
from skylift.data import PromptSample  # noqa: E402
from skylift.envs import make_env  # noqa: E402
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


@pytest.mark.parametrize(
    ("first_reply", "kept"),
    [("41 and then some", "41"), (" 41 then", "")],  # " 41" and "41" share no first id
    ids=["rewritten-to-a-prefix", "rewritten-to-new-text"],
)
def test_a_postprocessed_action_is_where_the_conversation_goes_on(
    tiny_model_dir: Path, first_reply: str, kept: str
) -> None:
    """SkyRL's ``postprocessed_action``: the next turn's context holds the rewritten text, not what
    was sampled; of the rewritten turn only the ids shared with the sampled ones are trained."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = FakeEngine(tokenizer, [first_reply, "42"])
    row = PromptSample(
        prompt=[{"role": "user", "content": "6 * 7?"}],
        env_class="skyrl_gym_example_env:FirstWordEnv",
        reward_spec=EXTRAS["reward_spec"],
        extra_info={},
        data_source="t",
        uid="0:0",
    )
    settings = GeneratorSettings(max_generate_length=8, max_turns=2, batched=False)
    gen = Generator(engine, tokenizer, settings)
    (traj,) = asyncio.run(gen.generate([row], 1, SamplingParams(max_tokens=8)))
    assert traj.reward == 1.0 and traj.num_turns == 2
    rewritten = (first_reply.split() or [""])[0]
    second_context = engine.prompts[1]
    decoded = tokenizer.decode(second_context)
    assert rewritten in decoded and first_reply not in decoded
    assert second_context == traj.prompt_ids + traj.response_ids[: len(second_context) - len(traj.prompt_ids)]
    trained = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 1]
    kept_ids = tokenizer.encode(kept, add_special_tokens=False) if kept else []
    assert trained == kept_ids + tokenizer.encode("42", add_special_tokens=False)
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 0)
    assert all(lp == -0.1 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 1)
    for index, _ in traj.turn_rewards[: 1 if kept else 0]:  # the rewritten turn's reward: on a trained id
        assert traj.loss_mask[index] == 1


ID_MODULE = """
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class EchoEnv(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


skyrl_gym.register(id="skylift_test_rows_id", entry_point="{module}:EchoEnv")
"""


def test_rows_naming_an_id_resolve_when_env_class_names_its_module(tmp_path: Path, monkeypatch) -> None:
    """Issue 41, item 6: environment.env_class=module:Class imports the module before the run, so
    rows naming an id that module registers resolve (as docs/coming_from_skyrl.md says)."""
    from skylift.config import load_config
    from skylift.envs import UnknownEnvironmentError
    from skylift.envs.registry import configure_run

    module = "skylift_test_rows_id_env"
    (tmp_path / f"{module}.py").write_text(ID_MODULE.replace("{module}", module))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownEnvironmentError, match="skylift_test_rows_id"):
        make_env("skylift_test_rows_id")  # nothing imported the module yet
    cfg = load_config([f"environment.env_class={module}:EchoEnv"])
    env = cfg.environment
    configure_run(env.env_class, env.import_modules, cfg.generator.max_turns, env)
    env = make_env("skylift_test_rows_id")
    assert isinstance(env, SkyRLGymEnv) and env.env_id == "skylift_test_rows_id"


def test_env_class_naming_a_missing_module_is_a_clear_error() -> None:
    from skylift.config import load_config
    from skylift.envs.registry import configure_run

    cfg = load_config(["environment.env_class=no_such_pkg_xyz.envs:Env"])
    with pytest.raises(ValueError, match=r"environment.env_class='no_such_pkg_xyz.envs:Env': cannot import"):
        configure_run(cfg.environment.env_class, [], 1, cfg.environment)
