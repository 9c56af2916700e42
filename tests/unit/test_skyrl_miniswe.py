"""SkyRL's mini-SWE-agent example on the gateway (`skylift.compat.skyrl.keys` maps its keys onto
``environment.harness`` with `skylift.integrations.mini_swe_agent.harness`), terminal-bench's refusal, and the
mini-SWE-agent entry point's parts that need no model (config, task, environment, verifier)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from skylift.compat.skyrl import keys as skyrl_keys
from skylift.config import ConfigError, load_config

MINISWE = [
    "trainer.algorithm.advantage_estimator=grpo",
    "generator.batched=true",
    "generator.max_turns=20",
    "generator.miniswe_config_path=examples/mini_swe_agent/swebench.yaml",
    "generator.miniswe_traj_dir=/tmp/trajs",
]


@pytest.mark.parametrize("docker", [False, True])
def test_skyrls_mini_swe_agent_keys_run_it_on_the_gateway_locally_without_docker(
    docker: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(skyrl_keys, "docker_available", lambda: docker)
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        cfg = load_config(MINISWE)
    h = cfg.environment.harness
    assert (h.entrypoint, h.verifier) == (
        "skylift.integrations.mini_swe_agent.harness:run",
        "skylift.integrations.mini_swe_agent.harness:verify",
    )
    options = {"config": "examples/mini_swe_agent/swebench.yaml", "traj_dir": "/tmp/trajs"}
    assert h.options == (options if docker else {**options, "environment": "local"})
    assert cfg.generator.batched is False  # the example's batched=true reached its own generator
    lines = [r.getMessage() for r in caplog.records if "mini-SWE-agent" in r.getMessage()]
    if docker:
        assert not lines
    else:
        assert len(lines) == 1 and "LocalEnvironment" in lines[0] and "Docker is absent" in lines[0]


def test_a_mini_swe_traj_dir_alone_and_terminal_bench_are_refused_naming_what_they_need() -> None:
    with pytest.raises(ConfigError, match="miniswe_traj_dir is set without generator.miniswe_config_path"):
        load_config(["generator.miniswe_traj_dir=/tmp/trajs"])
    with pytest.raises(ConfigError, match="Docker sandbox through Harbor, which skylift does not provide"):
        load_config(["++terminal_bench_config.trials_dir=/tmp/trials"])
    with pytest.raises(ConfigError, match="read only by SkyRL's mini-SWE-agent example"):
        load_config(["generator.miniswe_other=1"])


# ----------------------------------------------------------------- the entry point's parts

SETUP = "printf 'def add(a, b):\\n    return a {op} b\\n' > calc.py"
EVAL = "python3 -c 'from calc import add; assert add(2, 3) == 5'"


def _task(tmp: Path, op: str, options: dict | None = None) -> dict:
    instance = {"instance_id": "i1", "problem_statement": "fix add", "setup_script": SETUP.format(op=op)}
    return {
        "uid": "0:0",
        "prompt": [{"role": "user", "content": "ignored: the instance's statement counts"}],
        "columns": {"instance": {**instance, "eval_script": EVAL}},
        "data_source": "tiny",
        "workdir": str(tmp),
        "options": {"environment": "local", **(options or {})},
    }


def test_the_config_merges_like_mini_swe_agents_c_flags_and_the_verifier_runs_the_eval_script(
    tmp_path: Path,
) -> None:
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    pytest.importorskip("minisweagent")
    from skylift.integrations.mini_swe_agent import harness as miniswe

    (tmp_path / "short.yaml").write_text('run:\n  env_startup_command: "{{setup_script}}"\n')
    config = miniswe.miniswe_config(["mini.yaml", str(tmp_path / "short.yaml"), "agent.step_limit=2"])
    assert config["agent"]["step_limit"] == 2 and "{{task}}" in config["agent"]["instance_template"]
    assert config["run"]["env_startup_command"] == "{{setup_script}}"
    for op, reward in (("-", 0.0), ("+", 1.0)):
        work = tmp_path / f"work{op == '+'}"
        work.mkdir()
        task = _task(work, op)
        instance = miniswe.instance_of(task)
        assert instance["problem_statement"] == "fix add"
        env = miniswe.environment_of(config, instance, task["options"], str(work))
        assert (work / "calc.py").is_file() and env.config.cwd == str(work)
        verdict = miniswe.verify(task, "", str(work))
        assert verdict["reward"] == reward and verdict["metrics"]["miniswe_resolved"] == reward
    task = _task(tmp_path, "+")
    del task["columns"]["instance"]
    assert miniswe.instance_of(task)["problem_statement"].startswith("ignored")  # the prompt's
    with pytest.raises(ValueError, match="no eval_script"):
        miniswe.verify(task, "", str(tmp_path))
    (tmp_path / "bad.yaml").write_text('run:\n  env_startup_command: "exit 3"\n')
    with pytest.raises(RuntimeError, match="env_startup_command failed"):
        miniswe.environment_of(miniswe.miniswe_config(str(tmp_path / "bad.yaml")), {}, {}, str(tmp_path))


def test_swe_gym_and_swe_bench_instances_name_their_public_images() -> None:
    from skylift.integrations.mini_swe_agent.harness import swe_image

    assert (
        swe_image({"instance_id": "a__b-1"}, "SumanthRH/SWE-Gym")
        == "xingyaoww/sweb.eval.x86_64.a_s_b-1:latest"
    )
    assert (
        swe_image({"instance_id": "Django__x-2"}, "SWE-bench_Verified")
        == "swebench/sweb.eval.x86_64.django_1776_x-2:latest"
    )
    assert swe_image({"instance_id": "x"}, "mine") is None
