"""Running an agent program for one rollout, and scoring what it did.

Three contracts (docs/agentic.md, "Training an existing agent"):

- an entry point ``module:function(task, base_url)``, sync (run in a thread) or async, returning
  a reward, a dict (``reward``, ``output``, ``metrics``) or the output text;
- a command line, run in a fresh working directory holding ``task.json``, with ``OPENAI_BASE_URL``
  and ``OPENAI_API_KEY`` in its environment; its output is its stdout (or ``output_file``);
- a verifier over the output: ``env`` (the row's skylift environment: ``init`` on the row's
  prompt, then ``step(output)``; its extras hold ``harness_workdir``) or
  ``module:function(task, output, workdir)``.

Whatever goes wrong in an agent (an exception, a non-zero exit, the rollout's timeout) or in its
verifier is the rollout's `HarnessOutcome.error`: reward 0, the error logged, the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the API key agents are given (sessions are told apart by the URL, which is the secret)
GATEWAY_API_KEY = "skylift-gateway"
_TAIL = 2000  # characters of an agent's stderr kept in its error


@dataclass
class HarnessOutcome:
    """What one rollout of an agent gave."""

    reward: float | None = None
    output: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:function`` -> the function; ValueError naming `what` otherwise."""
    module, _, name = spec.rpartition(":")
    if not module or not name:
        raise ValueError(f"{what}={spec!r} must be module:function (or path/to/file.py:function)")
    try:
        target: Any = _import_file(module) if module.endswith(".py") else importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise ValueError(f"{what}={spec!r}: cannot import {module!r}: {exc}") from exc
    for part in name.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ValueError(f"{what}={spec!r}: {module} has no function {name!r}")
    return target  # type: ignore[no-any-return]


def _import_file(path: str) -> Any:
    """The module of the Python file `path` (an agent outside any package, e.g. in examples/)."""
    import importlib.util

    file = Path(path).expanduser().resolve()
    name = f"skylift_agent_{file.stem}_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None or not file.is_file():
        raise ImportError(f"no Python file at {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: awaited when async, else in a thread (a thread that outlives a timeout
    finishes unobserved; its session is closed by then)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result


def outcome_of(result: Any, who: str) -> HarnessOutcome:
    """An agent's or verifier's return value as a `HarnessOutcome`."""
    if isinstance(result, bool) or result is None:
        return HarnessOutcome(output=None) if result is None else HarnessOutcome(reward=float(result))
    if isinstance(result, int | float):
        return HarnessOutcome(reward=_finite(float(result), who))
    if isinstance(result, str):
        return HarnessOutcome(output=result)
    if isinstance(result, dict):
        unknown = sorted(set(result) - {"reward", "output", "metrics", "metadata"})
        if unknown:
            raise ValueError(
                f"{who} returned unknown key(s) {unknown}; known: metadata, metrics, output, reward"
            )
        reward = result.get("reward")
        metrics = result.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise ValueError(f"{who}: metrics must be a mapping of numbers")
        output = result.get("output")
        return HarnessOutcome(
            reward=None if reward is None else _finite(float(reward), who),
            output=None if output is None else str(output),
            metrics={str(k): float(v) for k, v in metrics.items()},
            metadata=dict(result.get("metadata") or {}),
        )
    raise ValueError(f"{who} returned {type(result).__name__}; expected a reward, a dict or the output text")


def _finite(value: float, who: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{who} returned a reward that is not finite: {value}")
    return value


async def run_entrypoint(fn: Callable[..., Any], task: dict[str, Any], base_url: str) -> HarnessOutcome:
    return outcome_of(await call_maybe_async(fn, task, base_url), "the entry point")


async def run_command(
    command: list[str], task: dict[str, Any], base_url: str, workdir: Path, output_file: str | None
) -> HarnessOutcome:
    """`command` in `workdir` (``task.json`` written there) with the gateway in its environment; a
    cancellation (the rollout's timeout) kills its process group."""
    (workdir / "task.json").write_text(json.dumps(task, default=str))
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": GATEWAY_API_KEY}
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = await process.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.wait(), 5.0)
        raise
    if process.returncode != 0:
        tail = stderr.decode(errors="replace")[-_TAIL:].strip()
        raise RuntimeError(f"{command[0]} exited with code {process.returncode}: {tail}")
    if output_file is None:
        return HarnessOutcome(output=stdout.decode(errors="replace"))
    path = workdir / output_file
    if not path.is_file():
        raise RuntimeError(f"{command[0]} wrote no {output_file} in its working directory")
    return HarnessOutcome(output=path.read_text(errors="replace"))


async def verify_with_function(
    fn: Callable[..., Any], task: dict[str, Any], output: str | None, workdir: Path
) -> HarnessOutcome:
    return outcome_of(await call_maybe_async(fn, task, output, str(workdir)), "the verifier")


async def verify_with_env(
    env: Any, prompt: Any, extras: dict[str, Any], output: str | None
) -> HarnessOutcome:
    """The row's environment scores the output: ``init`` on the prompt, one ``step(output)``."""
    try:
        await _env_call(env.init, prompt, extras)
        result = await _env_call(env.step, output or "")
    finally:
        with contextlib.suppress(Exception):
            await _env_call(env.close)
    return HarnessOutcome(
        reward=float(result.reward),
        metrics={k: float(v) for k, v in (result.metrics or {}).items()},
        metadata=dict(result.metadata or {}),
    )


async def _env_call(method: Callable[..., Any], *args: Any) -> Any:
    result = method(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def error_text(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) < _TAIL else text[:_TAIL] + "..."
