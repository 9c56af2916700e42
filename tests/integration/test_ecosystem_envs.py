"""Environments from the ecosystem in a real run: 2 GRPO steps of `skylift train`'s trainer on the
tiny model (the shared `tiny_server`), over a dataset whose rows name a tinker-cookbook
``EnvGroupBuilder`` (a real ``ProblemEnv``, token-level) and an OpenEnv environment (the real
``openenv-core`` client against the game server of tests/openenv_game.py on 127.0.0.1); and 2 GRPO
steps on a verifiers 0.4 taskset played by verifiers' own env server (tests/integration/
verifiers_server.py), which samples through the same server's /inference/v1/generate."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.generator import Trajectory
from skylift.integrations.verifiers.wire import VerifiersEnvClient
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

pytest.importorskip("openenv.core")
pytest.importorskip("tinker_cookbook")

from openenv_game import serve  # noqa: E402
from server_helpers import free_port  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import EnvGroupBuilder  # noqa: E402

COOKBOOK = f"tinker-cookbook:{__name__}:even_length_group"


class EvenLengthProblem(ProblemEnv):
    """A cookbook ProblemEnv rewarding a response of even length: random for the untrained tiny
    model, so GRPO groups get non-zero advantages."""

    def __init__(self, renderer: renderers.Renderer, question: str) -> None:
        super().__init__(renderer, format_coef=0.0)
        self.question = question

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return len(sample_str) % 2 == 0

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "an even number of characters"


def even_length_group(row: dict[str, Any], group_size: int, tokenizer: Any) -> EnvGroupBuilder:
    renderer = renderers.get_renderer("role_colon", tokenizer)
    question = str(row["prompt"][-1]["content"])
    return ProblemGroupBuilder(env_thunk=partial(EvenLengthProblem, renderer, question), num_envs=group_size)


@pytest.fixture(scope="module")
def game_url() -> Iterator[str]:
    url, stop = serve()
    yield url
    stop()


def data_with_env_class(out: Path, env_class: Any) -> Path:
    write_arithmetic_dataset(out, num_train=4, num_val=2, seed=0)
    table = pq.read_table(out / "train.parquet")
    column = pa.array([env_class(i) for i in range(table.num_rows)])
    pq.write_table(
        table.set_column(table.schema.get_field_index("env_class"), "env_class", column),
        out / "train.parquet",
    )
    return out


def run_config(data: Path, model: Path, server_url: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.epochs": 2,  # 4 prompts: one batch an epoch
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
        **extra,
    }


def train_two_steps(keys: dict[str, Any]) -> tuple[list[dict[str, float]], list[list[Trajectory]]]:
    """`skylift train`'s trainer for 2 steps; its metrics and the trajectories each step trained on."""
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in keys.items()]), console=False)
    trained: list[list[Trajectory]] = []
    update = trainer.update

    def recording_update(trajectories: list[Trajectory]) -> dict[str, float]:
        trained.append(list(trajectories))
        return update(trajectories)

    trainer.update = recording_update  # type: ignore[method-assign]
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2] and len(trained) == 2
    assert any(h["policy/grad_norm"] > 0 for h in steps)
    assert all(h["policy/logprob_diff_vs_rollout"] < 1e-3 for h in steps)  # the sampled ids, kept
    return steps, trained


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return data_with_env_class(
        tmp_path_factory.mktemp("ecosystem"), lambda i: COOKBOOK if i % 2 == 0 else "openenv"
    )


def test_two_grpo_steps_on_tinker_cookbook_and_openenv_envs(
    mixed_data: Path, tiny_model_dir: Path, tiny_server_url: str, game_url: str, tmp_path: Path
) -> None:
    keys = run_config(
        mixed_data,
        tiny_model_dir,
        tiny_server_url,
        tmp_path,
        **{"generator.max_turns": 2, "generator.batched": False, "environment.env_kwargs.base_url": game_url},
    )
    steps, trained = train_two_steps(keys)
    assert all("env/correct" in h for h in steps)  # the cookbook env's step metrics
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = renderers.get_renderer("role_colon", tokenizer)
    for batch in trained:
        cookbook = [tr for tr in batch if "observation" not in tr.env_metadata]
        games = [tr for tr in batch if "observation" in tr.env_metadata]
        assert len(cookbook) == 8 and len(games) == 8  # 2 prompts of each kind, 4 samples each
        for tr in cookbook:
            text = tokenizer.decode(tr.prompt_ids)
            assert text.startswith("User: ") and text.endswith("\n\nAssistant:")
            assert (
                tr.prompt_ids
                == renderer.build_generation_prompt(
                    [{"role": "user", "content": text.removeprefix("User: ").removesuffix("\n\nAssistant:")}]
                ).to_ints()
            )
            assert tr.reward in (0.0, 1.0) and tr.num_turns == 1
        for tr in games:
            assert 1 <= tr.num_turns <= 2
            assert tr.env_metadata["observation"]["message"].startswith(("Right.", "Wrong."))
            assert tr.reward == float(tr.env_metadata["observation"]["message"] == "Right.")


@pytest.fixture(scope="module")
def verifiers_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """verifiers' env server on tests/integration/verifiers_taskset.py, on 127.0.0.1: its address
    and its log."""
    pytest.importorskip("verifiers.v1")
    here = Path(__file__).resolve().parent
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("verifiers") / "env_server.log"
    path = os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH", "")) if p)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(here / "verifiers_server.py"), address],
            env={**os.environ, "PYTHONPATH": path},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        client = VerifiersEnvClient(address, health_timeout_s=120.0)

        async def up() -> None:
            try:
                await client.check()
            finally:
                await client.close()

        try:
            asyncio.run(up())
        except Exception:
            pytest.fail(f"verifiers env server did not start: {log.read_text()[-3000:]}")
        yield address, log
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_two_grpo_steps_on_a_verifiers_taskset(
    verifiers_server: tuple[str, Path], tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    address, log = verifiers_server
    data = data_with_env_class(tmp_path / "data", lambda i: "verifiers")
    keys = run_config(
        data, tiny_model_dir, tiny_server_url, tmp_path, **{"environment.verifiers.address": address}
    )
    try:
        _, trained = train_two_steps(keys)
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}\nenv server log:\n{log.read_text()[-6000:]}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = pq.read_table(data / "train.parquet").column("prompt").to_pylist()
    questions = [str(p[-1]["content"]) for p in rows]
    for version, batch in enumerate(trained):
        episodes: dict[str, list[Trajectory]] = {}
        for tr in batch:
            episodes.setdefault(tr.env_metadata["verifiers_episode"], []).append(tr)
            assert tr.reward in (0.0, 1.0) and tr.policy_version == version
            # every context's prompt is the chat template's rendering of a row's question (verifiers
            # may add its own notes to the task's prompt)
            prompt = tokenizer.decode(tr.prompt_ids)
            assert prompt.startswith("<|im_start|>") and any(q in prompt for q in questions)
            mask = tr.loss_mask
            assert mask[0] == 1 and mask[-1] == 1  # the response starts and ends with sampled tokens
            assert len(tr.rollout_logprobs) == len(tr.response_ids) == len(mask)
            assert all(lp <= 0 for lp, m in zip(tr.rollout_logprobs, mask, strict=True) if m)
            assert all(lp == 0 for lp, m in zip(tr.rollout_logprobs, mask, strict=True) if not m)
            if tr.num_turns == 2:  # one context: turn 1, the untrained "Again." turn, turn 2
                assert 0 in mask and "Again." in tokenizer.decode(tr.response_ids)
        # 4 prompts x 4 episodes; an episode is one context, or two when the second turn's prompt
        # (the template's rendering of the decoded first reply) is not the first context's ids
        assert len(episodes) == 16
        for contexts in episodes.values():
            assert sum(tr.num_turns for tr in contexts) == 2
            assert len({tr.reward for tr in contexts}) == 1  # the trace's reward
            assert "Again." in tokenizer.decode(
                [t for tr in contexts for t in tr.prompt_ids + tr.response_ids]
            )
