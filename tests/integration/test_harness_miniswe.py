"""mini-SWE-agent 2.4.6 from PyPI, unmodified (its `DefaultAgent`, LiteLLM model and
`LocalEnvironment`), trained for 2 GRPO steps through the gateway (`skylift.integrations.mini_swe_agent.harness`) on
the tiny model: each rollout's working directory gets a throw-away git repository (the config's
``run.env_startup_command``, as SkyRL's rows set theirs up), the agent works in it, and the
verifier runs the repository's test there. The untrained model fixes nothing (it makes no tool
call: mini-SWE-agent stops after three format errors); the test checks the pipeline: the calls
captured and trained, the verifier's 0 (a buggy repository) and 1 (one already right), no error."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skylift.config import load_config
from skylift.generator import Trajectory
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner at the import below
pytest.importorskip("minisweagent", reason="mini-swe-agent is in the dev extra (pyproject.toml)")

SETUP = """set -e
cat > calc.py <<'EOF'
def add(a, b):
    return a {op} b
EOF
cat > test_calc.py <<'EOF'
import unittest
from calc import add
class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
EOF
git init -q . && git add . && git -c user.name=t -c user.email=t@t commit -q -m init
"""
# merged over mini-SWE-agent's own mini.yaml: short prompts (the tiny model's context is 512
# tokens) and the start-up command that builds the repository
SHORT = """agent:
  system_template: You fix bugs with the bash tool.
  instance_template: "Fix: {{task}}"
model:
  format_error_template: "{{error}}"
run:
  env_startup_command: "{{setup_script}}"
"""


def _instance(name: str, op: str) -> dict[str, str]:
    return {
        "instance_id": name,
        "problem_statement": "add(2, 3) must be 5 in calc.py.",
        "setup_script": SETUP.format(op=op),
        "eval_script": "python3 -m unittest -q test_calc",
    }


def test_two_grpo_steps_of_mini_swe_agent_with_its_local_environment(
    tiny_model_dir: Path, tiny_server_url: str, tmp_path: Path
) -> None:
    rows = [("buggy", "-"), ("fixed", "+")]
    data = tmp_path / "train.parquet"
    table = {
        "data_source": ["tiny-swe"] * 2,
        "prompt": [[{"role": "user", "content": "add(2, 3) must be 5 in calc.py."}]] * 2,
        "env_class": ["null"] * 2,  # as SkyRL's mini-SWE-agent rows: the verifier scores them
        "instance": [_instance(name, op) for name, op in rows],
        "reward_spec": [{"ground_truth": ""}] * 2,  # skylift's prompt schema wants both columns
        "extra_info": [{"index": i} for i in range(2)],
    }
    pq.write_table(pa.table(table), data)
    trajs = tmp_path / "trajs"
    keys: dict[str, Any] = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": f"['{data}']",
        "data.val_data": "[]",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{tiny_server_url.removeprefix('http://')}']",
        "generator.override_existing_update_group": True,
        "generator.n_samples_per_prompt": 2,
        "generator.max_generate_length": 8,
        "trainer.train_batch_size": 1,
        "trainer.policy_mini_batch_size": 1,
        "trainer.max_prompt_length": 448,
        "trainer.max_steps": 2,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.ckpt_interval": -1,
        "trainer.resume_mode": "none",
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
        "environment.harness.entrypoint": "skylift.integrations.mini_swe_agent.harness:run",
        "environment.harness.verifier": "skylift.integrations.mini_swe_agent.harness:verify",
        "environment.harness.options.environment": "local",
        "environment.harness.options.traj_dir": str(trajs),
        "environment.harness.max_concurrent": 2,
        "environment.harness.timeout_s": 90,
    }
    (tmp_path / "short.yaml").write_text(SHORT)
    keys["environment.harness.options.config"] = f"['mini.yaml','{tmp_path / 'short.yaml'}']"
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
    assert all(h["env/harness_errors"] == 0 for h in steps)
    rewards = {}
    for batch in trained:
        last = [tr for tr in batch if tr.last_step]
        assert len(last) == 2  # the row's two rollouts
        for tr in last:
            assert tr.metrics["harness_errors"] == 0, tr.env_metadata
            # no tool call from the untrained model: three format errors, three captured calls
            assert tr.metrics["harness_calls"] == tr.metrics["miniswe_model_calls"] == 3, tr.metrics
            assert tr.env_metadata["miniswe_exit_status"] == "RepeatedFormatError"
            rewards[tr.uid] = tr.reward
            assert tr.reward == tr.metrics["miniswe_resolved"]
        for tr in batch:
            assert sum(tr.loss_mask) > 0 and len(tr.rollout_logprobs) == len(tr.response_ids)
    # the verifier's verdicts: the buggy repository's test fails, the right one's passes
    by_name = {"0:0": "buggy", "0:1": "fixed"}
    assert {by_name[uid]: r for uid, r in rewards.items()} == {"buggy": 0.0, "fixed": 1.0}
    assert len(list(trajs.glob("*.traj.json"))) == 4  # mini-SWE-agent's own trajectory files
