"""2 GRPO steps of `skylift train`'s trainer on the tiny model, the rollouts played by an ordinary
`openai`-client tool loop (tests/integration/harness_tool_agent.py, no skylift import) that reaches
the policy only through the gateway (`environment.harness`), sampling through the session's
`tiny_server`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.generator import Trajectory
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

AGENT = Path(__file__).with_name("harness_tool_agent.py")


def test_two_grpo_steps_through_a_plain_openai_tool_loop(
    tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_arithmetic_dataset(data, num_train=4, num_val=2, seed=0)
    keys: dict[str, Any] = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{tiny_server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "trainer.max_prompt_length": 256,
        "trainer.max_steps": 2,
        "trainer.epochs": 2,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
        "environment.harness.entrypoint": f"{AGENT}:run",
        "environment.harness.verifier": f"{AGENT}:even_length",
        "environment.harness.max_concurrent": 8,
        "environment.harness.timeout_s": 120,
    }
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
    assert all(h["env/harness_errors"] == 0 for h in steps)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = [
        str(p[-1]["content"]) for p in pq.read_table(data / "train.parquet").column("prompt").to_pylist()
    ]
    for version, batch in enumerate(trained):
        rollouts: dict[str, list[Trajectory]] = {}
        for tr in batch:
            rollouts.setdefault(f"{tr.uid}|{tr.trajectory_id}", []).append(tr)
            assert tr.reward in (0.0, 1.0) and tr.policy_version == version
            prompt = tokenizer.decode(tr.prompt_ids)
            assert prompt.startswith("<|im_start|>") and any(q in prompt for q in questions)
            assert tr.loss_mask[0] == 1 and tr.loss_mask[-1] == 1
            assert all(lp == 0 for lp, m in zip(tr.rollout_logprobs, tr.loss_mask, strict=True) if not m)
        assert len(rollouts) == 16  # 4 prompts x 4 rollouts
        for steps_of in rollouts.values():
            last = steps_of[-1]
            assert last.last_step and len({tr.reward for tr in steps_of}) == 1
            # the rollout's figures ride on its last sample (`env/<name>` averages over samples)
            assert last.metrics["agent_turns"] == 2 and last.metrics["harness_calls"] == 2, last.metrics
            assert last.metrics["harness_errors"] == 0, last.env_metadata
            text = tokenizer.decode([t for tr in steps_of for t in tr.prompt_ids + tr.response_ids])
            merged = [tr for tr in steps_of if 0 in tr.loss_mask]
            # two calls: one sequence with the untrained turn in between, or two samples (the
            # untrained model's text seldom re-tokenises to the ids it sampled) of which the
            # second's prompt is the first call's prompt and reply, replayed, and the next turn
            assert merged or len(steps_of) == 2, text
            if not merged:
                first, second = steps_of
                said = tokenizer.decode(first.prompt_ids + first.response_ids, skip_special_tokens=True)
                assert tokenizer.decode(second.prompt_ids, skip_special_tokens=True).startswith(said)
