"""More tinker-cookbook 0.6.1 recipes, unmodified, against `skylift tinker serve` (the session's
`tinker_server`, tiny model, `role_colon` renderer, offline):

- `preference/train_dpo` on a local JSONL comparison file (`ComparisonBuilderFromJsonl`) with a
  held-out test file, so the recipe evaluates every step: `forward_backward_custom` (the DPO loss
  runs client-side) and the reference sampler it made at the start, used again after every newer
  evaluation sampler;
- on-policy distillation (`distillation/train_on_policy`) on the arithmetic environment, the
  teacher an SFT checkpoint of this server (a sampler from `save_weights_for_sampler`);
- multi-turn RL: `multiplayer_rl/guess_number` (its `build_config`, the server reached through
  `TINKER_BASE_URL` since the recipe's config has no base_url);
- prompt distillation: the teacher answers with a long instruction prompt, the answers go to a
  JSONL conversation file without it, `prompt_distillation/train.cli_main` fine-tunes on that file,
  and the result is sampled. (The recipe's own `create_data` cannot run on the tiny model: its
  instruction prompt alone is 2315 tokens, above tiny-qwen2's 2048-token context, and it names a
  hosted teacher; the teacher-sampling step is rewritten here, the training step is the recipe's.)
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
RENDERER = "role_colon"
DPO_STEPS = 6


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def cookbook(tinker_server: Any) -> Iterator[None]:
    """What the cookbook needs to run offline against `tinker_server`."""
    import tinker_cookbook.utils.cost_estimation as cost_estimation

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setenv("TINKER_BASE_URL", tinker_server.url)  # for recipes whose config has no base_url
        mp.setattr(cost_estimation, "_pricing_fetched", True)  # no pricing download
        yield


def _comparison(i: int) -> dict[str, Any]:
    a, b = i % 7 + 1, i % 5 + 2
    right = {"role": "assistant", "content": f"{a + b}"}
    wrong = {"role": "assistant", "content": f"{a + b + 3} or so"}
    first, second, label = (right, wrong, "A") if i % 2 == 0 else (wrong, right, "B")
    return {
        "comparison": {
            "prompt_conversation": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "completion_A": [first],
            "completion_B": [second],
        },
        "label": label,
    }


def test_train_dpo_evaluating_every_step(
    cookbook: None, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    model = str(tiny_model_dir)
    train_file = _write_jsonl(tmp_path / "train.jsonl", [_comparison(i) for i in range(2 * DPO_STEPS)])
    test_file = _write_jsonl(tmp_path / "test.jsonl", [_comparison(100 + i) for i in range(2)])
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="skylift_test_dpo",
        renderer_name=RENDERER,
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=128, batch_size=2
            ),
            comparison_builder=ComparisonBuilderFromJsonl(
                train_path=str(train_file), test_path=str(test_file)
            ),
        ),
        learning_rate=1e-2,
        dpo_beta=0.5,
        lora_rank=4,
        base_url=tinker_server.url,
        eval_every=1,
        infrequent_eval_every=0,
        save_every=3,
        ttl_seconds=3600,
    )
    train_dpo.main(config)

    rows = _jsonl(log_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(DPO_STEPS))
    for row in rows:
        assert row["num_pairs"] == 2
        assert math.isfinite(row["dpo_loss"]) and row["dpo_loss"] > 0
        # every step evaluated on a fresh sampler of the current weights
        assert math.isfinite(row["test/nll"]) and row["test/nll"] > 0
    # step 0: the policy IS the reference, so the reference sampler's logprobs (engine) equal the
    # trainer's: zero margin and the loss is log 2
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert abs(rows[0]["margin"]) < 2e-3
    # the reference sampler still answers at the last step, after five newer samplers, and the
    # policy has moved away from it (the margin is no longer zero)
    assert abs(rows[-1]["margin"]) > 1e-3
    assert rows[-1]["test/nll"] != rows[0]["test/nll"]
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["000003", "final"]
    assert saved[-1]["epoch"] == 1


@pytest.fixture(scope="module")
def teacher(cookbook: None, tinker_server: Any, tiny_model_dir: Path) -> str:
    """A sampler checkpoint of the tiny model after a few SFT steps (the distillation teacher)."""
    import tinker
    from tinker import types
    from tinker_helpers import sft_dataset

    service = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    for _ in range(3):
        tc.forward_backward(sft_dataset(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("teacher").result().path
    service.close("success").result(timeout=60)
    return path


def test_on_policy_distillation_from_an_sft_teacher(
    teacher: str, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder

    model = str(tiny_model_dir)
    steps = 3
    log_path = tmp_path / "distill"
    config = train_on_policy.Config(
        learning_rate=1e-3,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=ArithmeticDatasetBuilder(
                    batch_size=2,
                    group_size=2,
                    model_name_for_tokenizer=model,
                    renderer_name=RENDERER,
                    n_batches=steps,
                ),
                teacher_config=TeacherConfig(base_model=model, load_checkpoint_path=teacher),
                groups_per_batch=2,
            )
        ],
        model_name=model,
        recipe_name="skylift_test_distill",
        renderer_name=RENDERER,
        max_tokens=6,
        lora_rank=4,
        log_path=str(log_path),
        base_url=tinker_server.url,
        eval_every=0,
        save_every=2,
    )
    asyncio.run(train_on_policy.main(config))

    rows = _jsonl(log_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), rows
    for row in rows:
        # the student (base model + fresh LoRA) is not the teacher: the reverse KL on the student's
        # own samples is non-zero, and it is the only signal (no reward), so the gradient is too
        assert math.isfinite(row["teacher_kl"]) and row["teacher_kl"] != 0
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row["env/all/ac_tokens_per_turn"] > 0
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["000002", "final"]
    assert saved[-1]["batch"] == steps


def test_guess_number_multi_turn_rl(
    cookbook: None, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess_number

    log_path = tmp_path / "guess-number"
    config = guess_number.build_config(
        guess_number.CLIConfig(
            model_name=str(tiny_model_dir),
            renderer_name=RENDERER,
            group_size=2,
            batch_size=2,
            learning_rate=1e-3,
            max_tokens=6,
            eval_every=0,
            save_every=0,
            log_path=str(log_path),
            max_steps=2,
        )
    )
    asyncio.run(guess_number.train.main(config))

    rows = [r for r in _jsonl(log_path / "metrics.jsonl") if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        # multi-turn: the environment answered and the player guessed again (the random tiny model
        # never parses as "Guess: <n>", so every episode runs its 10 turns at -1 each)
        assert 1 < row["env/all/turns_per_episode"] <= 10
        assert -10 <= row["env/all/reward/total"] < 0
        assert math.isfinite(row["grad_norm"])
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["final"] and saved[0]["batch"] == 2


INSTRUCTION = "You answer every question with one short line. Think of the number, then say it. Question: "


def test_prompt_distillation(teacher: str, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.prompt_distillation import train as prompt_distillation
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    model = str(tiny_model_dir)
    service = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    tokenizer = get_tokenizer(model)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    questions = [f"what is {i} times {i + 2}?" for i in range(8)]

    # 1. the teacher answers with the instruction in its prompt (greedy, so the answers are a
    #    function of the prompt); the data file keeps the question alone
    teacher_client = service.create_sampling_client(base_model=model, model_path=teacher).result()
    params = tinker.SamplingParams(max_tokens=8, temperature=0.0, stop=renderer.get_stop_sequences())
    data_file = tmp_path / "prompt_distillation.jsonl"
    rows = []
    for q in questions:
        prompt = renderer.build_generation_prompt([{"role": "user", "content": INSTRUCTION + q}])
        result = teacher_client.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
        message, _ = renderer.parse_response(result.sequences[0].tokens)
        answer = renderers.get_text_content(message)
        assert answer, "the teacher answered nothing"
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]})
    _write_jsonl(data_file, rows)

    # 2. the recipe's training CLI on that file
    log_path = tmp_path / "prompt-distill"
    prompt_distillation.cli_main(
        prompt_distillation.CLIConfig(
            file_path=str(data_file),
            log_path=str(log_path),
            model_name=model,
            base_url=tinker_server.url,
            renderer_name=RENDERER,
            learning_rate=3e-3,
            lr_schedule="constant",
            num_epochs=4,
            lora_rank=8,
            max_length=256,
            batch_size=8,
            save_every=0,
            eval_every=0,
            behavior_if_log_dir_exists="delete",
        )
    )
    metrics = _jsonl(log_path / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    nll = [r["train_mean_nll"] for r in metrics]
    assert all(math.isfinite(x) for x in nll) and nll[-1] < nll[0], nll
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["final"]

    # 3. sampling from the result, without the instruction: the student now gives the teacher's
    #    answers more probability than the base model does
    student = service.create_sampling_client(base_model=model, model_path=saved[0]["sampler_path"]).result()
    base = service.create_sampling_client(base_model=model).result()
    sample = student.sample(
        prompt=renderer.build_generation_prompt([{"role": "user", "content": questions[0]}]),
        sampling_params=tinker.SamplingParams(max_tokens=8, temperature=1.0),
        num_samples=2,
    ).result()
    assert len(sample.sequences) == 2 and all(s.tokens for s in sample.sequences)

    def answer_nll(client: Any) -> float:
        total = 0.0
        for row in rows:
            tokens, weights = renderer.build_supervised_example(row["messages"])
            logprobs = client.compute_logprobs(tokens).result()
            w = weights.tolist()
            total -= sum(lp * wi for lp, wi in zip(logprobs[1:], w[1:], strict=True) if lp is not None)
        return total

    assert answer_nll(student) < answer_nll(base)
    service.close("success").result(timeout=60)
