"""mini-SWE-agent (PyPI ``mini-swe-agent`` 2.x, unmodified) as a harness: its `DefaultAgent` and
model class talk to the rollout's gateway URL; its environment runs the agent's commands.

- ``environment.harness.entrypoint=skylift.integrations.mini_swe_agent.harness:run``: one rollout of the agent on the
  row's task (the ``instance`` column's ``problem_statement``, as the seed's mini-SWE-agent rows
  hold, else the prompt's last user message);
- ``environment.harness.verifier=skylift.integrations.mini_swe_agent.harness:verify``: reward 1 when the instance's
  ``eval_script`` exits 0 (the seed's rule), run in the rollout's working directory (local) or in a
  fresh container with the agent's patch applied (Docker).

``environment.harness.options``: ``config``, a mini-SWE-agent config spec or a list of them merged
in order as its ``-c`` flags are (a YAML path, a built-in name like ``mini.yaml`` or
``swebench.yaml``, or ``key=value``; default ``mini.yaml``); ``environment`` (``local``: its
`LocalEnvironment` in the rollout's working directory; else a mini-SWE-agent environment class, by
default the config's, with the instance's image); ``traj_dir``, where each rollout's trajectory is
saved (``<instance_id>.<rollout>.traj.json``); ``eval_timeout_s`` (300). The config's
``run.env_startup_command``, rendered with the instance, runs first in the environment (a local
task brings its repository this way). The model is ``openai/<model_name>`` through LiteLLM at the
gateway, with cost tracking off and no retries of a refused call (the gateway is local: a
refusal is final, e.g. the budget).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from skylift.gateway.harness import GATEWAY_API_KEY

DEFAULT_CONFIG = "mini.yaml"
EVAL_TIMEOUT_S = 300
_TAIL = 2000  # characters of the eval script's output kept


def _quiet() -> None:
    """mini-SWE-agent and LiteLLM without their start-up banner, cost-map download and retries."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")


def miniswe_config(spec: Any) -> dict[str, Any]:
    """The mini-SWE-agent config of `spec` (one spec or a list, merged in order)."""
    _quiet()
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    specs = [spec] if isinstance(spec, str | Path) else list(spec or [DEFAULT_CONFIG])
    return recursive_merge(*(get_config_from_spec(str(s)) for s in specs))


def instance_of(task: dict[str, Any]) -> dict[str, Any]:
    """The row's SWE task: its ``instance`` column (the seed's rows), else one made of its prompt."""
    instance = task.get("columns", {}).get("instance") or task.get("extra_info", {}).get("instance")
    if isinstance(instance, dict):
        return dict(instance)
    users = [m for m in task.get("prompt", []) if m.get("role") == "user"]
    return {
        "instance_id": str(task.get("uid", "task")),
        "problem_statement": users[-1]["content"] if users else "",
    }


def environment_kind(config: dict[str, Any], options: dict[str, Any]) -> str:
    """``options.environment``, else the config's ``environment.environment_class``, else local."""
    return str(
        options.get("environment") or (config.get("environment") or {}).get("environment_class") or "local"
    )


def swe_image(instance: dict[str, Any], data_source: str) -> str | None:
    """The public evaluation image of a SWE-Gym or SWE-bench instance (by their naming), or None."""
    iid = str(instance.get("instance_id", ""))
    source = data_source.lower()
    if "swe-gym" in source:
        return f"xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}:latest".lower()
    if "swe-bench" in source:
        return f"swebench/sweb.eval.x86_64.{iid.replace('__', '_1776_')}:latest".lower()
    return None


def environment_of(
    config: dict[str, Any],
    instance: dict[str, Any],
    options: dict[str, Any],
    workdir: str,
    data_source: str = "",
) -> Any:
    """The environment the agent's commands run in, after the config's start-up command."""
    from jinja2 import Template

    settings = dict(config.get("environment") or {})
    kind = environment_kind(config, options)
    settings.pop("environment_class", None)
    if kind == "local":
        from minisweagent.environments.local import LocalEnvironment

        env: Any = LocalEnvironment(**{**settings, "cwd": workdir})
    else:
        from minisweagent.environments import get_environment

        image = instance.get("image_name") or settings.get("image") or swe_image(instance, data_source)
        if not image:
            raise ValueError(f"environment {kind!r} needs an image: the instance has no image_name")
        env = get_environment({**settings, "environment_class": kind, "image": image})
    startup = (config.get("run") or {}).get("env_startup_command")
    if startup:
        out = env.execute({"command": Template(startup).render(**instance)})
        if out["returncode"] != 0:
            raise RuntimeError(
                f"run.env_startup_command failed ({out['returncode']}): {out['output'][-_TAIL:]}"
            )
    return env


def run(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """One rollout of mini-SWE-agent's `DefaultAgent` through the gateway at `base_url`."""
    options = dict(task.get("options") or {})
    config = miniswe_config(options.get("config"))
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models import get_model

    instance = instance_of(task)
    env = environment_of(config, instance, options, task["workdir"], str(task.get("data_source", "")))
    model_config = dict(config.get("model") or {})
    model_config["model_name"] = "openai/policy"  # LiteLLM's OpenAI-compatible client
    model_config["model_kwargs"] = {
        **(model_config.get("model_kwargs") or {}),
        "api_base": base_url,
        "api_key": GATEWAY_API_KEY,
    }
    model_config["cost_tracking"] = "ignore_errors"
    agent_config = dict(config.get("agent") or {})
    agent_config.pop("output_path", None)
    if options.get("traj_dir"):
        name = f"{instance.get('instance_id', 'task')}.{Path(task['workdir']).name}.traj.json"
        agent_config["output_path"] = Path(options["traj_dir"]).expanduser() / name
    agent = DefaultAgent(get_model(config=model_config), env, **agent_config)
    try:
        result = agent.run(str(instance.get("problem_statement", "")))
    finally:
        cleanup = getattr(env, "cleanup", None)
        if callable(cleanup) and environment_kind(config, options) != "local":
            cleanup()
    status = str(result.get("exit_status", ""))
    return {
        "output": str(result.get("submission") or ""),
        "metrics": {
            "miniswe_model_calls": float(agent.n_calls),
            "miniswe_submitted": float(status == "Submitted"),
        },
        "metadata": {"miniswe_exit_status": status},
    }


def verify(task: dict[str, Any], output: str | None, workdir: str) -> dict[str, Any]:
    """Reward 1 when the instance's ``eval_script`` exits 0 (its output's tail in the metadata)."""
    options = dict(task.get("options") or {})
    instance = instance_of(task)
    script = instance.get("eval_script")
    if not script:
        raise ValueError("the instance has no eval_script to score the rollout with")
    timeout = int(options.get("eval_timeout_s", EVAL_TIMEOUT_S))
    config = miniswe_config(options.get("config"))
    if environment_kind(config, options) == "local":
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout,
        )
        code, text = done.returncode, done.stdout
    else:  # a fresh container: the agent's patch, then the eval script
        env = environment_of(config, instance, options, workdir, str(task.get("data_source", "")))
        try:
            applied = env.execute(
                {"command": f"git apply <<'END_OF_PATCH_3f9c'\n{output or ''}\nEND_OF_PATCH_3f9c"}
            )
            out = applied
            if applied["returncode"] == 0:
                out = env.execute(
                    {"command": f"bash <<'END_OF_EVAL_3f9c'\n{script}\nEND_OF_EVAL_3f9c"}, timeout=timeout
                )
        finally:
            cleanup = getattr(env, "cleanup", None)
            if callable(cleanup):
                cleanup()
        code, text = out["returncode"], out["output"]
    return {
        "reward": float(code == 0),
        "metrics": {"miniswe_resolved": float(code == 0)},
        "metadata": {"miniswe_eval_returncode": code, "miniswe_eval_output": text[-_TAIL:]},
    }
