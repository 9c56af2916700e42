"""``environment.harness.*``: train an existing agent program through skylift's OpenAI-compatible
gateway (`skylift.gateway`; docs/agentic.md, "Training an existing agent")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.config.fields import _f

HARNESS_TOOL_PARSERS = ("hermes", "llama3_json", "xml")


@dataclass
class HarnessConfig:
    """An agent program run once per rollout against the gateway; its model calls are the samples."""

    entrypoint: str | None = _f(
        None,
        "a Python agent, module:function (or path/file.py:function) (task, base_url) -> reward | "
        "dict, sync or async, run once per rollout",
    )
    command: list[str] = _f(
        [],
        "an agent command line run once per rollout in a fresh working dir (task.json there), with "
        "OPENAI_BASE_URL and OPENAI_API_KEY in its environment; needs a verifier",
    )
    verifier: str | None = _f(
        None,
        "what scores a rollout's output: env (the row's skylift environment steps on it), "
        "module:function(task, output, workdir) -> reward | dict, or null (the entry point's own reward)",
    )
    options: dict[str, Any] = _f(
        {},
        "settings handed to the agent and its verifier as task['options'] (e.g. the mini-SWE-agent "
        "entry point's config, traj_dir, environment; environment.harness.options.x=1)",
    )
    output_file: str | None = _f(
        None, "command: the file in the working dir whose text is the output; null = its stdout"
    )
    max_concurrent: int = _f(32, "rollouts of the agent running at once, over the whole run", ge=1)
    timeout_s: float = _f(600.0, "the longest one rollout may run; then it is stopped and scores 0", gt=0)
    max_calls: int = _f(32, "budget: most model calls per rollout (a call over it gets HTTP 400)", ge=1)
    max_tokens: int = _f(
        16384, "budget: most sampled tokens per rollout (a call's max_tokens is cut to what is left)", ge=1
    )
    max_session_s: float = _f(
        600.0, "budget: seconds from a rollout's start after which its model calls are refused", gt=0
    )
    tool_parser: str = _f(
        "hermes",
        f"how tool calls are read from the sampled text: {' | '.join(HARNESS_TOOL_PARSERS)}",
        choices=HARNESS_TOOL_PARSERS,
    )
    model_name: str = _f("policy", "the model name the gateway's /v1/models serves")
    host: str = _f("127.0.0.1", "address the gateway listens on (loopback; sessions are unguessable)")


def harness_problems(h: HarnessConfig) -> list[str]:
    """What is wrong with ``environment.harness`` (nothing when no agent is set)."""
    p = "environment.harness"
    if not h.entrypoint and not h.command:
        return [
            f"{p}.{k} is set but neither {p}.entrypoint nor {p}.command" for k in _AGENT_ONLY if _set(h, k)
        ]
    problems: list[str] = []
    if h.entrypoint and h.command:
        problems.append(f"{p}.entrypoint and {p}.command are exclusive: set one")
    if h.entrypoint and ":" not in h.entrypoint:
        problems.append(f"{p}.entrypoint={h.entrypoint!r} must be module:function or path/file.py:function")
    if h.command and not h.verifier:
        problems.append(f"{p}.command needs {p}.verifier (env or module:function): a command has no reward")
    if h.verifier and h.verifier != "env" and ":" not in h.verifier:
        problems.append(f"{p}.verifier={h.verifier!r} must be env or module:function")
    if h.output_file and not h.command:
        problems.append(f"{p}.output_file goes with {p}.command")
    return problems


_AGENT_ONLY = ("verifier", "output_file", "options")


def _set(h: HarnessConfig, key: str) -> bool:
    return getattr(h, key) not in (None, {})


def command_list(command: Any) -> list[str]:
    """`command` as a list of arguments (a single string is split like a shell would)."""
    import shlex

    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]
