"""The Tinker cookbook's own training loops (tinker-cookbook 0.6.1, unmodified) against our server.

`tinker_cookbook.supervised.train` fine-tunes the tiny model on the cookbook's shipped
`example_data/conversations.jsonl`; `tinker_cookbook.rl.train` then runs RL on the cookbook's
arithmetic environment, starting from the SFT run's final checkpoint with a KL penalty against the
base model (the random tiny model never earns a reward, so the KL term is what makes the
advantages, and the gradients, non-zero). Both run offline: a local model directory as the model
name (it is also the tokenizer), the `role_colon` renderer, and no pricing download. The cookbook
reaches the server through `Config.base_url` and the `TINKER_API_KEY` environment variable.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinker

pytestmark = pytest.mark.integration

API_KEY = "tml-dummy"
RENDERER = "role_colon"
SFT_STEPS = 3
SFT_BATCH = 8
RL_STEPS = 2


@dataclass
class Run:
    """A finished cookbook run: its log directory and what the server said around it."""

    log_path: Path
    status_before: dict[str, Any]
    status_after: dict[str, Any]

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.log_path / "metrics.jsonl").read_text().splitlines()]

    def checkpoints(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.log_path / "checkpoints.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cookbook(tinker_server: Any) -> Iterator[None]:
    """What the cookbook needs to run offline against `tinker_server`."""
    import tinker_cookbook.utils.cost_estimation as cost_estimation

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setattr(cost_estimation, "_pricing_fetched", True)  # no pricing download
        yield


def _run(server: Any, log_path: Path, main: Any, config: Any) -> Run:
    before = server.status()
    asyncio.run(main(config))
    return Run(log_path=log_path, status_before=before, status_after=server.status())


@pytest.fixture(scope="module")
def sft_run(
    cookbook: None, tinker_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    import tinker_cookbook
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    assert conversations.is_file(), "tinker-cookbook no longer ships example_data/conversations.jsonl"
    model = str(tiny_model_dir)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        max_length=256,
        batch_size=SFT_BATCH,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    log_path = tmp_path_factory.mktemp("cookbook") / "sft"
    config = train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="skylift_test_sft",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        learning_rate=1e-3,
        lora_rank=8,
        base_url=tinker_server.url,
        max_steps=SFT_STEPS,
        save_every=2,
        eval_every=0,
    )
    return _run(tinker_server, log_path, train.main, config)


def _run_id(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


def _assert_on_server(server: Any, checkpoints: list[dict[str, Any]]) -> tinker.RestClient:
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    for ckpt in checkpoints:
        listed = rest.list_checkpoints(_run_id(ckpt["state_path"])).result().checkpoints
        assert {ckpt["state_path"], ckpt["sampler_path"]} <= {c.tinker_path for c in listed}
    return rest


def test_supervised_train(sft_run: Run, tinker_server: Any) -> None:
    rows = sft_run.metrics()
    assert [r["step"] for r in rows] == list(range(SFT_STEPS))
    for row in rows:
        assert row["num_sequences"] == SFT_BATCH
        assert math.isfinite(row["train_mean_nll"]) and row["train_mean_nll"] > 0
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    assert rows[-1]["progress"] == 1.0

    checkpoints = sft_run.checkpoints()
    assert [c["name"] for c in checkpoints] == [f"{SFT_STEPS - 1:06d}", "final"]
    rest = _assert_on_server(tinker_server, checkpoints)
    run = rest.get_training_run(_run_id(checkpoints[-1]["state_path"])).result()
    assert run.is_lora and run.lora_rank == 8
    assert (run.user_metadata or {}).get("renderer_name") == RENDERER
    # Saving sampler weights with every checkpoint does not start an inference engine.
    assert sft_run.status_after["engine_start_attempts"] == sft_run.status_before["engine_start_attempts"]


def test_rl_train_from_sft_checkpoint(
    sft_run: Run, tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    model = str(tiny_model_dir)
    builder = ArithmeticDatasetBuilder(
        batch_size=2,
        group_size=4,
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        n_batches=RL_STEPS,
    )
    log_path = tmp_path / "rl"
    config = train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="skylift_test_rl",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=1e-3,
        max_tokens=8,
        lora_rank=8,
        base_url=tinker_server.url,
        load_checkpoint_path=sft_run.checkpoints()[-1]["state_path"],
        kl_penalty_coef=1.0,
        kl_reference_config=train.KLReferenceConfig(base_model=model),
        eval_every=0,
        save_every=0,
    )
    run = _run(tinker_server, log_path, train.main, config)

    steps = [r for r in run.metrics() if "env/all/reward/total" in r]
    assert [r["step"] for r in steps] == list(range(RL_STEPS))
    for row in steps:
        assert math.isfinite(row["env/all/reward/total"])
        # The policy starts from the SFT weights, so it differs from the base model...
        assert row["kl_policy_base"] != 0 and math.isfinite(row["kl_policy_base"])
        # ... and the KL penalty gives non-zero advantages, hence gradients.
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        # The engine's sampling logprobs agree with the trainer's for the same weights.
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3
        assert math.isfinite(row["optim/entropy"])

    checkpoints = run.checkpoints()
    assert [c["name"] for c in checkpoints] == ["final"] and checkpoints[0]["batch"] == RL_STEPS
    assert checkpoints[0]["cumulative_tokens"]["sampled"] > 0
    _assert_on_server(tinker_server, checkpoints)
    assert any(e["started"] for e in run.status_after["engines"])
