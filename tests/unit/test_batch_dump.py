"""``trainer.dump_data_batch``: the batch each step trains on, written where SkyRL writes it."""

from __future__ import annotations

from pathlib import Path

import torch
from rl_fakes import fake_run


def test_each_steps_training_batch_is_written_and_reads_back_safely(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=2", "trainer.dump_data_batch=true")
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    dumped = tmp_path / "exports" / "dumped_data"
    names = sorted(p.name for p in dumped.iterdir())
    assert names == ["global_step_1_training_input.pkl", "global_step_2_training_input.pkl"]
    assert all(h["timing/dump_data_batch_s"] >= 0.0 for h in history)
    cfg = run.trainer.cfg
    rows = cfg.trainer.train_batch_size * cfg.generator.n_samples_per_prompt
    for step, name in enumerate(names):
        record = torch.load(dumped / name, weights_only=True)  # tensors, numbers and strings only
        ids, mask = record["input_ids"], record["response_mask"]
        assert ids.shape[0] == rows == len(record["uids"]) == len(record["data_sources"])
        assert mask.shape == (rows, ids.shape[1] - record["prompt_len"])
        advantages = record["extras"]["advantages"]
        assert advantages.shape == mask.shape and record["rewards"].shape == (rows,)
        assert bool((advantages[mask == 0] == 0).all()) and bool(advantages.abs().sum() > 0)
        assert "rollout_logprobs" in record["extras"]
        assert record["policy_versions"] == [step] * rows  # synchronous: sampled by the step's policy
        # a GRPO group's advantages sum to 0 over its samples' first response token
        first = advantages[:, 0]
        for uid in set(record["uids"]):
            group = [i for i, u in enumerate(record["uids"]) if u == uid]
            assert abs(float(first[group].sum())) < 1e-4


def test_no_dump_unless_asked(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "trainer.max_steps=1")
    try:
        history = [h for h in run.trainer.fit() if "timing/step_s" in h]
    finally:
        run.close()
    assert not (tmp_path / "exports" / "dumped_data").exists()
    assert "timing/dump_data_batch_s" not in history[0]
