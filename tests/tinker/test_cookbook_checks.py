"""Two more tinker-cookbook recipes, through their own code, against `skylift tinker serve` (the
session's `tinker_server`, tiny model, offline):

- `recipes/rl_numerics_check`: the cookbook's check of RL training numerics, a `read_page`
  tool-use counting environment whose RL loop logs `optim/kl_sample_train_v1`/`_v2` (the
  sampler's logprobs of the sampled tokens against the trainer's). Its `train.py` path runs
  (`CLIConfig` -> `build_config` -> `rl.train.main`, as its CLI does) with tiny settings, and
  two changes: (1) its corpus comes from the Hugging Face hub (`load_wikitext_corpus` loads
  `Salesforce/wikitext`), so that one function returns skylift's built-in English-like corpus
  (`skylift.models.tiny_corpus`) instead; (2) the config `build_config` returns gets
  `load_checkpoint_path` (an `rl.train.Config` field the recipe's CLI does not expose): a LoRA
  state after 6 SFT steps on the recipe's prompts, so the logprobs compared are those of a
  trained adapter (a fresh LoRA's B is zero: sampler and trainer would both be the base model)
  and step 1 usually samples weights step 0 moved. The renderer is `qwen3_instruct` (ChatML with
  Hermes tool calls; the tiny model speaks ChatML, `role_colon` has no tool calling). Episodes
  are single-turn: the tiny model never writes a `<tool_call>`; SmolLM2-135M-Instruct with the
  same renderer and prompt did not either (0 of 8 samples), and 30 SFT steps towards a
  `read_page` call (~12 s) left the tiny model at 1.4 nats per call token with no parseable call
  in its samples, so neither buys multi-turn coverage at an acceptable cost (the guess_number
  test in `test_cookbook_recipes.py` runs multi-turn RL).
- `recipes/rubric`: RL whose reward comes from a grader LLM reading a rubric. Its data comes from
  its own `generate_data.generate_dataset` (written under tmp_path), `train.cli_main` trains and
  evaluates on the test file before every step and at the end, and the grader is a sampler of the same tiny base model on the same server (`grader_llm_name`; the
  recipe builds the grader's `ServiceClient` with no base_url, so it reaches the server through
  `TINKER_BASE_URL`). One change: the recipe hard-codes the grader's `max_tokens=2048`, the tiny
  model's whole context, so every grader request (a ~280-token prompt + 2048) is refused as
  exceeding the context, by skylift as by Tinker itself (HTTP 400, "Prompt length plus
  max_tokens exceeds the model's context window"); the grader completer is the recipe's
  `TinkerMessageCompleter` with `max_tokens` lowered to GRADER_MAX_TOKENS.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
# The sampler's and the trainer's logprobs of the same tokens, fp32 tiny model on CPU: measured
# |kl_sample_train_v1| 4e-9 to 2.6e-7 over 20 steps of 10 runs, kl_sample_train_v2 up to 1e-12
# (vLLM's CPU kernels and the trainer's PyTorch forward sum in different orders). 1e-5 leaves
# ~40x margin and still catches a real mismatch (a wrong or stale adapter, a shifted token: the
# adapter here moves logprobs by whole nats).
KL_TOLERANCE = 1e-5
GRADER_MAX_TOKENS = 64
RENDERER = "qwen3_instruct"
SFT_STEPS = 6
GROUPS, GROUP_SIZE, MAX_TOKENS = 2, 4, 8


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cookbook(tinker_server: Any) -> Any:
    """What the cookbook needs to run offline against `tinker_server`."""
    import tinker_cookbook.utils.cost_estimation as cost_estimation

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setenv("TINKER_BASE_URL", tinker_server.url)  # for clients built without a base_url
        mp.setattr(cost_estimation, "_pricing_fetched", True)  # no pricing download
        yield


def _counting_corpus() -> str:
    from skylift.models.tiny_corpus import build_corpus

    return "\n".join(build_corpus())


def _task() -> Any:
    from tinker_cookbook.recipes.rl_numerics_check.env import CountingTaskConfig

    return CountingTaskConfig(num_pages_min=2, num_pages_max=2, page_chars=100)


@pytest.fixture(scope="module")
def answerer(cookbook: None, tinker_server: Any, tiny_model_dir: Path) -> str:
    """A LoRA training state of the tiny model after SFT_STEPS steps on the recipe's own prompts
    answered with "Answer: <count>" (~3 s): the RL run starts from it (`load_checkpoint_path`),
    so the sampler and the trainer compare logprobs under a non-zero adapter. The adapter ends
    some replies within max_tokens (parsed, reward 0) and not others (cut, -0.1), so groups often
    have mixed rewards and step 1 samples weights step 0 moved (often, not always: sampling is
    random, so the test does not assert it)."""
    import random

    import tinker
    from tinker_cookbook.recipes.rl_numerics_check import env as numerics_env
    from tinker_cookbook.renderers import get_renderer
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    model = str(tiny_model_dir)
    renderer = get_renderer(RENDERER, get_tokenizer(model))
    task, corpus = _task(), _counting_corpus()
    data = []
    for seed in range(2):
        problem = numerics_env.sample_problem(random.Random(seed), corpus, task)
        reader = numerics_env.PageReader(problem.pages, numerics_env.EpisodeState())
        convo = renderer.create_conversation_prefix_with_tools(
            tools=[reader.read_page.to_spec()], system_prompt=numerics_env.SYSTEM_PROMPT
        ) + [
            {"role": "user", "content": problem.prompt},
            {"role": "assistant", "content": f"Answer: {problem.true_count}"},
        ]
        data.append(conversation_to_datum(convo, renderer, max_length=None))

    service = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=model, rank=4).result()
    for _ in range(SFT_STEPS):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_state("answerer").result().path
    service.close("success").result(timeout=60)
    return path


def test_rl_numerics_check(
    answerer: str,
    tinker_server: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import chz
    from tinker_cookbook import cli_utils
    from tinker_cookbook.recipes.rl_numerics_check import env as numerics_env
    from tinker_cookbook.recipes.rl_numerics_check import train as numerics

    corpus = _counting_corpus()
    monkeypatch.setattr(numerics_env, "load_wikitext_corpus", lambda *a, **k: corpus)

    log_path = tmp_path / "rl-numerics"
    cli = numerics.CLIConfig(
        model_name=str(tiny_model_dir),
        renderer_name=RENDERER,
        lora_rank=4,
        learning_rate=1e-3,
        group_size=GROUP_SIZE,
        groups_per_batch=GROUPS,
        max_tokens=MAX_TOKENS,
        max_trajectory_tokens=1800,
        task=_task(),
        eval_every=0,
        save_every=0,
        max_steps=2,
        base_url=tinker_server.url,
        log_path=str(log_path),
        behavior_if_log_dir_exists="delete",
    )
    config = chz.replace(numerics.build_config(cli), load_checkpoint_path=answerer)
    cli_utils.check_log_dir(config.log_path, behavior_if_exists=cli.behavior_if_log_dir_exists)
    asyncio.run(numerics.train.main(config))

    rows = [r for r in _metrics(log_path) if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        print(
            f"step {row['step']}: kl_sample_train_v1={row['optim/kl_sample_train_v1']:.3e} "
            f"v2={row['optim/kl_sample_train_v2']:.3e} entropy={row['optim/entropy']:.3f} "
            f"grad_norm={row['grad_norm']:.3g}"
        )
        assert abs(row["optim/kl_sample_train_v1"]) < KL_TOLERANCE
        assert 0 <= row["optim/kl_sample_train_v2"] < KL_TOLERANCE**2
        # the sampler serves the trained adapter: the base tiny model is near uniform over its
        # 1024 tokens (entropy ln 1024 = 6.93), the adapter's distribution is much narrower
        assert 0 < row["optim/entropy"] < 5
        assert row["env/all/total_episodes"] == GROUPS * GROUP_SIZE
        # one turn each (the model never calls read_page), every turn sampled and scored
        assert row["env/all/turns_per_episode"] == 1
        assert 0 < row["env/all/ac_tokens_per_turn"] <= MAX_TOKENS
        # the prompt holds the read_page tool spec, the system prompt and the task
        assert row["env/all/ob_tokens_per_turn"] > 300
        # -0.1 for a reply cut at max_tokens, 0 for one without "Answer: <n>", up to 1 for a count
        assert -0.1 <= row["env/all/reward/total"] <= 1
        assert math.isfinite(row["grad_norm"])


def test_rubric_graded_rl(
    cookbook: None, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_cookbook.completers import TinkerMessageCompleter
    from tinker_cookbook.recipes.rubric import env as rubric_env
    from tinker_cookbook.recipes.rubric import generate_data
    from tinker_cookbook.recipes.rubric import train as rubric

    train_path, test_path = generate_data.generate_dataset(
        num_train=4, num_test=2, seed=0, write_dir=str(tmp_path)
    )
    grader_calls: list[tuple[str, str]] = []  # (prompt, reply)

    class Grader(TinkerMessageCompleter):
        """The recipe's grader completer, its max_tokens lowered to fit the tiny model's context."""

        def __init__(self, sampling_client: Any, renderer: Any, max_tokens: int, **kwargs: Any) -> None:
            assert max_tokens == 2048  # what the recipe asks for
            super().__init__(sampling_client, renderer, GRADER_MAX_TOKENS, **kwargs)

        async def __call__(self, messages: list[Any]) -> Any:
            reply = await super().__call__(messages)
            grader_calls.append((messages[0]["content"], reply["content"]))
            return reply

    monkeypatch.setattr(rubric_env, "TinkerMessageCompleter", Grader)

    model = str(tiny_model_dir)
    log_path = tmp_path / "rubric"
    asyncio.run(
        rubric.cli_main(
            rubric.CLIConfig(
                model_name=model,
                lora_rank=4,
                renderer_name="role_colon",
                train_group_size=2,
                groups_per_batch=2,
                learning_rate=1e-3,
                max_tokens=8,
                grader_llm_name=model,
                grader_renderer_name="role_colon",
                train_jsonl_path=train_path,
                test_jsonl_path=test_path,
                log_path=str(log_path),
                eval_every=1,
                save_every=0,
                base_url=tinker_server.url,
                behavior_if_log_dir_exists="delete",
                max_steps=2,
            )
        )
    )

    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        assert row["env/all/total_episodes"] == 4
        assert 0 <= row["env/all/rubric_score"] <= 1
        # reward = rubric score - 0.1 when the policy's reply did not end at the stop sequence
        assert -0.1 <= row["env/all/reward/total"] <= 1
        assert math.isfinite(row["optim/kl_sample_train_v1"])
    # the recipe's test set (2 datapoints, one sample each) is graded before each step and at the end
    evals = [r for r in _metrics(log_path) if "test/env/all/rubric_score" in r]
    assert [r["step"] for r in evals] == [0, 1, 2], evals
    for row in evals:
        assert row["test/env/all/total_episodes"] == 2
        assert 0 <= row["test/env/all/rubric_score"] <= 1
        assert -0.1 <= row["test/env/all/reward/total"] <= 1
    # one grader call per episode (training and evaluation), each reading the rubric of its
    # generated datapoint, each answered with sampled text (the random grader's text holds no
    # <score>, so the recipe scores 0)
    assert len(grader_calls) == 2 * 4 + 3 * 2
    assert all("<rubric>\nDoes the chatbot correctly get the answer" in p for p, _ in grader_calls)
    assert any(reply.strip() for _, reply in grader_calls)
    # the recipe's own log of the first step shows the grader's verdicts
    html = (log_path / "iteration_000000" / "train.html").read_text()
    assert "Per-rubric scores" in html
