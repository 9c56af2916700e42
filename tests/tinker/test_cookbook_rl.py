"""Cookbook RL recipes with their default loss (`stable_reinforce`) against the server, unmodified:
`recipes/rl_loop.py` (interrupted, then rerun on the same log_path: it resumes from its checkpoint)
and async `rl.train` two steps off-policy.

Offline harness only: GSM8K rows come from the local JSONL copy (the recipe calls
`datasets.load_dataset`), the renderer is `role_colon` (a local model directory has no recommended
one), and since the random tiny model never writes a correct ``\\boxed{}`` answer, rl_loop's reward
is replaced by a rule on the response tokens so that advantages, and so the loss, are non-zero.
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
RENDERER = "role_colon"


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]


class Interrupted(Exception):
    pass


def test_rl_loop_default_loss_then_resume(
    tinker_server: Any, tiny_model_dir: Path, gsm8k_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    from tinker_cookbook.recipes import rl_loop

    rows = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()[:8]]
    table = datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])
    interrupt_at: list[int | None] = [4]  # the first run dies selecting batch 2 (rows 4..5)

    class Rows:
        def __len__(self) -> int:
            return len(table)

        def select(self, indices: range) -> Any:
            if interrupt_at[0] is not None and indices.start >= interrupt_at[0]:
                raise Interrupted(f"interrupted at row {indices.start}")
            return table.select(indices)

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setattr(rl_loop.datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict(train=Rows()))
    monkeypatch.setattr(rl_loop.model_info, "get_recommended_renderer_name", lambda name: RENDERER)
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response) % 2))
    log_path = tmp_path / "rl-loop"
    config = rl_loop.Config(
        base_url=tinker_server.url,
        log_path=str(log_path),
        model_name=str(tiny_model_dir),
        batch_size=2,
        group_size=4,
        learning_rate=1e-3,
        lora_rank=4,
        save_every=2,
        max_tokens=8,
        ttl_seconds=3600,
    )
    assert config.loss_fn == "stable_reinforce"
    with pytest.raises(Interrupted):
        rl_loop.main(config)
    first = _metrics(log_path)
    assert [r["progress/batch"] for r in first] == [0, 1]
    assert [c["name"] for c in _checkpoints(log_path)] == ["000002"]

    interrupt_at[0] = None
    rl_loop.main(config)
    rows_after = _metrics(log_path)
    assert [r["progress/batch"] for r in rows_after] == [0, 1, 2, 3]  # resumed at batch 2
    trained = [r for r in rows_after if "grad_norm" in r or "optim/grad_norm" in r]
    assert trained, f"no training step ran: {rows_after}"
    for r in rows_after:
        assert math.isfinite(r["reward/total"])
    saved = _checkpoints(log_path)
    # the resumed run (a new training run from the checkpoint) saves 000002 again, then final
    assert [c["name"] for c in saved] == ["000002", "000002", "final"]
    assert saved[1]["state_path"] != saved[0]["state_path"] and saved[2]["batch"] == 4


def _moved_lora_checkpoint(server: Any) -> str:
    """A LoRA state two SFT steps away from the base model (so the KL penalty is not zero)."""
    import tinker
    from tinker import types
    from tinker_helpers import sft_dataset

    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = service.create_lora_training_client(base_model="tiny-qwen2", rank=4).result()
    for _ in range(2):
        tc.forward_backward(sft_dataset(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("async-start").result().path
    service.close("success").result(timeout=60)
    return path


def test_async_rl_train_two_steps_off_policy(
    tinker_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import tinker_cookbook.utils.cost_estimation as cost_estimation
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    model = str(tiny_model_dir)
    start = _moved_lora_checkpoint(tinker_server)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setattr(cost_estimation, "_pricing_fetched", True)
        config = train.Config(
            log_path=str(tmp_path / "async-rl"),
            model_name=model,
            recipe_name="skylift_test_async_rl",
            renderer_name=RENDERER,
            dataset_builder=ArithmeticDatasetBuilder(
                batch_size=2,
                group_size=4,
                model_name_for_tokenizer=model,
                renderer_name=RENDERER,
                n_batches=6,
            ),
            learning_rate=1e-3,
            max_tokens=6,
            lora_rank=4,
            base_url=tinker_server.url,
            # the tiny model earns no reward: the KL penalty against the base model makes the
            # advantages, so the policy starts away from the base model
            load_checkpoint_path=start,
            kl_penalty_coef=1.0,
            kl_reference_config=train.KLReferenceConfig(base_model=model),
            async_config=train.AsyncConfig(max_steps_off_policy=2, groups_per_batch=2),
            max_steps=4,
            eval_every=0,
            save_every=0,
        )
        assert config.training_loss_fn() == "stable_reinforce"
        asyncio.run(train.main(config))
    steps = [r for r in _metrics(tmp_path / "async-rl") if "grad_norm" in r or "optim/grad_norm" in r]
    assert len(steps) == 4
    for row in steps:
        norm = row.get("grad_norm", row.get("optim/grad_norm"))
        assert math.isfinite(norm) and norm > 0
    names = [c["name"] for c in _checkpoints(tmp_path / "async-rl")]
    assert names[-1] == "final", names  # (a run loaded from a checkpoint first records it as 000000)
