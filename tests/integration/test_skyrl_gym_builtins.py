"""SkyRL-Gym's built-in ``gsm8k_multi_turn``, ``text2sql`` and ``search`` environments, named by
their ids in the rows' ``env_class``, in one real run: 2 GRPO steps of `skylift train`'s trainer on
the tiny model (the session's `tiny_server`, weights synced to it after each step), over SkyRL-format
parquet files (tests/skyrl_gym_data.py), with text2sql on SQLite databases made here and search
against a BM25 retrieval server on 127.0.0.1 (tests/bm25_retrieval.py).

The untrained model writes no ``<sql>``, ``<solution>``, ``<search>`` or ``<answer>``: every rollout
runs its 2 turns (``generator.max_turns``) and the envs answer as skyrl-gym's code says: text2sql
"invalid action" then -1 (SkyRL-SQL's format check), search an empty ``<information>`` block (no
query reaches the server) then 0, gsm8k_multi_turn its "final numeric answer" prompt then 0. That the
search env really retrieves is checked in tests/unit/test_skyrl_gym_builtin_envs.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("skyrl_gym", reason="skyrl-gym is a dependency of skylift (pyproject)")
pytest.importorskip("rank_bm25", reason="rank-bm25 is in skylift's dev extra (pyproject)")

from bm25_retrieval import RetrievalServer, serve  # noqa: E402
from skyrl_gym_data import (  # noqa: E402
    CORPUS,
    gsm8k_multi_turn_rows,
    make_sql_databases,
    search_rows,
    text2sql_rows,
    write_rows,
)

from skylift.config import load_config  # noqa: E402
from skylift.generator import Trajectory  # noqa: E402
from skylift.rl.build import build_trainer  # noqa: E402

MAX_TURNS = 2
# what each env answers the untrained model after turn 1 (see the module docstring)
OBSERVATIONS = {
    "text2sql": "Your previous action is invalid",
    "search": "<information></information>",
    "gsm8k_multi_turn": "Now provide only the final numeric answer",
}


@pytest.fixture(scope="module")
def retrieval() -> Iterator[RetrievalServer]:
    server = serve(CORPUS)
    yield server
    server.stop()


def train_two_steps(keys: dict[str, Any]) -> tuple[list[dict[str, float]], list[list[Trajectory]], list[int]]:
    """`skylift train`'s trainer for 2 steps: its step metrics, the trajectories each step trained
    on, and the versions it synced to the engines."""
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in keys.items()]), console=False)
    trained: list[list[Trajectory]] = []
    synced: list[int] = []
    update, weights = trainer.update, trainer.parts.weights
    sync = weights.sync

    def recording_update(trajectories: list[Trajectory]) -> dict[str, float]:
        trained.append(list(trajectories))
        return update(trajectories)

    def recording_sync(version: int) -> dict[str, float]:
        synced.append(version)
        return sync(version)

    trainer.update = recording_update  # type: ignore[method-assign]
    weights.sync = recording_sync  # type: ignore[method-assign]
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return [h for h in history if "reward/mean" in h], trained, synced


def test_gsm8k_multi_turn_text2sql_and_search_train_two_grpo_steps(
    tiny_model_dir: Path, tiny_server_url: str, retrieval: RetrievalServer, tmp_path: Path
) -> None:
    db_path = make_sql_databases(tmp_path / "sql_data")
    files = [
        write_rows(tmp_path / "gsm8k_multi_turn.parquet", gsm8k_multi_turn_rows(MAX_TURNS)),
        write_rows(tmp_path / "text2sql.parquet", text2sql_rows()),
        write_rows(tmp_path / "search.parquet", search_rows()),
    ]
    keys = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": "[" + ",".join(f"'{f}'" for f in files) + "]",
        "data.val_data": "[]",
        "environment.skyrl_gym.text2sql.db_path": str(db_path),
        "environment.skyrl_gym.search.search_url": retrieval.url,
        "environment.skyrl_gym.search.timeout": 10,
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{tiny_server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "generator.max_turns": MAX_TURNS,
        "generator.batched": False,
        "generator.n_samples_per_prompt": 2,
        "generator.max_generate_length": 8,
        "generator.max_input_length": 400,  # room for both turns: every rollout reaches its env's end
        "trainer.train_batch_size": 6,
        "trainer.policy_mini_batch_size": 6,
        "trainer.max_prompt_length": 256,
        "trainer.max_steps": 2,
        "trainer.epochs": 2,  # 6 prompts: one batch an epoch
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
    }
    steps, trained, synced = train_two_steps(keys)
    assert [h["step"] for h in steps] == [1, 2] and len(trained) == 2
    assert synced == [0, 1, 2]  # set-up's, then each step's weights went to the server
    # (every group's rewards are equal for the untrained model, so GRPO's advantages are 0: the
    # point here is the environments, not the learning)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for version, batch in enumerate(trained):
        by_env: dict[str, list[Trajectory]] = {}
        for tr in batch:
            by_env.setdefault(tr.env_class, []).append(tr)
            assert tr.policy_version == version  # sampled by the weights synced after the step before
        assert {env: len(group) for env, group in by_env.items()} == {
            "gsm8k_multi_turn": 4,
            "text2sql": 4,
            "search": 4,
        }  # 2 prompts of each, 2 samples each
        for env_class, group in by_env.items():
            for tr in group:
                assert tr.num_turns == MAX_TURNS, (env_class, tokenizer.decode(tr.response_ids))
                response = tokenizer.decode(tr.response_ids)
                assert OBSERVATIONS[env_class] in response  # the env's own answer, untrained
                assert 0 in tr.loss_mask and tr.loss_mask[0] == 1 and tr.loss_mask[-1] == 1
        assert all(tr.reward == -1.0 for tr in by_env["text2sql"])
        assert all(tr.reward == 0.0 for tr in by_env["search"])
        # turn rewards 0, or 0.2 / max_turns for a well-formed wrong "#### n"
        assert all(r in (0.0, 0.1) for tr in by_env["gsm8k_multi_turn"] for _, r in tr.turn_rewards)
        assert all(
            tr.env_metadata["env_metrics"] == {"steps": MAX_TURNS} for tr in by_env["gsm8k_multi_turn"]
        )
    assert retrieval.queries == []  # nothing the model wrote was a <search> query
    for h, batch in zip(steps, trained, strict=True):
        assert h["environment/gsm8k_multi_turn/avg_steps"] == MAX_TURNS  # GSM8kMultiTurnEnv's aggregate
        assert h["environment/text2sql/reward_mean"] == -1.0
        assert h["environment/search/reward_mean"] == 0.0
        gsm = [tr.reward for tr in batch if tr.env_class == "gsm8k_multi_turn"]
        assert h["environment/gsm8k_multi_turn/reward_mean"] == pytest.approx(sum(gsm) / len(gsm))
        assert h["policy/logprob_diff_vs_rollout"] < 1e-3  # the sampled ids, kept
