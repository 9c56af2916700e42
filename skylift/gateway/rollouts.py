"""`HarnessRollouts`: the run's generator when ``environment.harness`` names an agent program.

Every row's ``n`` rollouts run the agent (`skylift.gateway.harness`) against its own gateway
session, at most ``max_concurrent`` at once over the run, each within ``timeout_s``; the
session's calls become the rollout's trajectories (`skylift.gateway.trajectories`), all with
the reward the agent or its verifier gave. Call k of sample j of a row samples with the row's
seed + j + k * `CALL_SEED_STRIDE`, as turn k of skylift's own agent loop does.

It is the ``harness`` plugin of `skylift.generator.plugins`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skylift.config.harness import HarnessConfig, command_list
from skylift.envs import make_env
from skylift.gateway.harness import (
    HarnessOutcome,
    error_text,
    load_callable,
    run_command,
    run_entrypoint,
    verify_with_env,
    verify_with_function,
)
from skylift.gateway.server import Gateway, GatewayLimits
from skylift.gateway.session import Budget, Session
from skylift.gateway.trajectories import session_trajectories
from skylift.generator.plugins import RolloutContext, register_rollout_plugin
from skylift.generator.rollout_errors import rollout_of
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import SamplingParams

logger = logging.getLogger("skylift.gateway")


@dataclass
class HarnessSettings:
    """``environment.harness`` checked (see `skylift.config.harness.HarnessConfig`)."""

    entrypoint: str | None = None
    command: list[str] = field(default_factory=list)
    verifier: str | None = None
    output_file: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    max_concurrent: int = 32
    timeout_s: float = 600.0
    budget: Budget = field(default_factory=Budget)
    tool_parser: str = "hermes"
    model_name: str = "policy"
    host: str = "127.0.0.1"

    @classmethod
    def of(cls, h: HarnessConfig) -> HarnessSettings | None:
        """None when no agent is set."""
        if not h.entrypoint and not h.command:
            return None
        return cls(
            entrypoint=h.entrypoint,
            command=command_list(h.command),
            verifier=h.verifier,
            output_file=h.output_file,
            options=dict(h.options or {}),
            max_concurrent=h.max_concurrent,
            timeout_s=h.timeout_s,
            budget=Budget(h.max_calls, h.max_tokens, h.max_session_s),
            tool_parser=h.tool_parser,
            model_name=h.model_name,
            host=h.host,
        )


class HarnessRollouts:
    """Rolls out rows by running the agent program against the gateway (all rows)."""

    def __init__(self, inner: Any, settings: HarnessSettings, default_env_class: str) -> None:
        s = inner.settings
        self.inner = inner  # skylift's generator: its settings, tokenizer and the verifier envs' parts
        self.settings = settings
        self.default_env_class = default_env_class
        self.agent = (
            load_callable(settings.entrypoint, "environment.harness.entrypoint")
            if settings.entrypoint
            else None
        )
        verifier = settings.verifier
        self.verify_fn = (
            load_callable(verifier, "environment.harness.verifier")
            if verifier and verifier != "env"
            else None
        )
        self.gateway = Gateway(
            inner.engine,
            inner.tokenizer,
            GatewayLimits(
                max_input_length=s.max_input_length or s.max_prompt_length + s.max_generate_length,
                max_generate_length=s.max_generate_length,
                engine_versions=s.engine_versions,
                routed_experts=s.routed_experts,
            ),
            tool_parser=settings.tool_parser,
            model_name=settings.model_name,
            host=settings.host,
            template_kwargs=s.chat_template_kwargs,
        )
        self._limits: dict[Any, asyncio.Semaphore] = {}
        self._rollouts = 0

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.settings.max_concurrent)
        return self._limits[loop]

    async def generate(
        self,
        rows: Sequence[Any],
        n: int,
        params: SamplingParams,
        policy_version: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """The trajectories of `n` rollouts per row, grouped by row in order (a rollout may be
        several samples: one per call that does not extend the one before)."""
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} seeds for {len(rows)} rows")
        await self.gateway.start()
        one = SamplingParams(**{**params.to_dict(), "n": 1})
        jobs = [
            self._rollout(row, j, one, policy_version, None if seeds is None else seeds[i] + j)
            for i, row in enumerate(rows)
            for j in range(n)
        ]
        out = [tr for rollout in await asyncio.gather(*jobs) for tr in rollout]
        names = {row.uid: row.env_class or self.default_env_class for row in rows}
        for tr in out:
            tr.env_class = names.get(tr.uid, "")
        return out

    async def _rollout(
        self, row: Any, j: int, params: SamplingParams, policy_version: int, seed: int | None
    ) -> list[Trajectory]:
        """One rollout of `row`. The agent's and its verifier's failures are its error (`_run`:
        reward 0, the run goes on); what fails after them on the row itself (its prompt, rendered
        as the stand-in of an agent that made no call, that the chat template cannot render) is
        marked as the row's (`rollout_of`), which stops training on one line."""
        with rollout_of(row.uid):
            return await self._play(row, params, policy_version, seed)

    async def _play(
        self, row: Any, params: SamplingParams, policy_version: int, seed: int | None
    ) -> list[Trajectory]:
        async with self._limit():
            self._rollouts += 1
            rollout_id = f"harness-{self._rollouts}"
            session = Session(params, policy_version, self.settings.budget, seed=seed)
            url = self.gateway.open(session)
            # in a thread: making and removing a directory waits on the disk (ms), not the loop
            workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="skylift-harness-"))
            task = _task_of(row, workdir, self.settings.options)
            try:
                outcome = await self._run(row, task, url, workdir)
            finally:
                self.gateway.close(session)
                await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)
        metrics = {
            **outcome.metrics,
            "harness_calls": float(len(session.calls)),
            "harness_tool_calls": float(session.tool_calls),
            "harness_errors": float(outcome.error is not None),
            "harness_budget_stops": float(session.stop_reason is not None),
        }
        metadata = dict(outcome.metadata)
        if outcome.error is not None:
            metadata["harness_error"] = outcome.error
        s = self.inner.settings
        tokenizer = self.inner.tokenizer
        return session_trajectories(
            row,
            session,
            0.0 if outcome.error is not None or outcome.reward is None else outcome.reward,
            rollout_id,
            stand_in_prompt=self.gateway.render(list(row.prompt)) if not session.calls else [],
            stand_in_token=int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0),
            zero_reward_on_non_stop=s.zero_reward_on_non_stop,
            overlong_filtering=s.apply_overlong_filtering,
            metadata=metadata,
            metrics=metrics,
        )

    async def _run(self, row: Any, task: dict[str, Any], url: str, workdir: Path) -> HarnessOutcome:
        """The agent, then its verifier; any failure is the outcome's error (reward 0, logged)."""
        h = self.settings
        try:
            if self.agent is not None:
                outcome = await asyncio.wait_for(run_entrypoint(self.agent, task, url), h.timeout_s)
            else:
                outcome = await asyncio.wait_for(
                    run_command(h.command, task, url, workdir, h.output_file), h.timeout_s
                )
            if h.verifier == "env":
                verdict = await verify_with_env(
                    self._verifier_env(row), list(row.prompt), _extras(row, workdir), outcome.output
                )
            elif self.verify_fn is not None:
                verdict = await verify_with_function(self.verify_fn, task, outcome.output, workdir)
            else:
                verdict = HarnessOutcome()
                if outcome.reward is None:
                    raise ValueError(
                        "the agent returned no reward and environment.harness.verifier is not set"
                    )
        except Exception as exc:  # noqa: BLE001 - a crashing agent scores 0; the run goes on
            message = error_text(exc)
            logger.warning("harness rollout of %s failed: %s", row.uid, message)
            return HarnessOutcome(error=message)
        return HarnessOutcome(
            reward=verdict.reward if verdict.reward is not None else outcome.reward,
            output=outcome.output,
            metrics={**outcome.metrics, **verdict.metrics},
            metadata={**outcome.metadata, **verdict.metadata},
        )

    def _verifier_env(self, row: Any) -> Any:
        s = self.inner.settings
        env = make_env(row.env_class or self.default_env_class, **(s.env_kwargs or {}))
        env.llm = self.inner.llm
        env.tool_runner = self.inner.tool_runner
        env.tokenizer = self.inner.tokenizer
        return env

    async def aclose(self) -> None:
        await self.gateway.aclose()


def _task_of(row: Any, workdir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """What the agent is given of a row (also ``task.json`` of a command's working directory)."""
    return {
        "uid": row.uid,
        "prompt": list(row.prompt),
        "reward_spec": dict(row.reward_spec or {}),
        "extra_info": dict(row.extra_info or {}),
        "data_source": row.data_source,
        "columns": dict(getattr(row, "columns", None) or {}),  # the row's other columns
        "workdir": str(workdir),
        "options": dict(options),
    }


def _extras(row: Any, workdir: Path) -> dict[str, Any]:
    return {
        **(getattr(row, "columns", None) or {}),
        "reward_spec": row.reward_spec,
        "extra_info": row.extra_info,
        "data_source": row.data_source,
        "harness_workdir": str(workdir),
    }


class _HarnessPlugin:
    """``environment.harness`` as a rollout plugin of `skylift.generator.plugins`."""

    def check(self, options: Any) -> HarnessSettings | None:
        return HarnessSettings.of(options if isinstance(options, HarnessConfig) else HarnessConfig(**options))

    def wrap(self, generator: Any, settings: HarnessSettings, context: RolloutContext) -> HarnessRollouts:
        return HarnessRollouts(generator, settings, context.default_env_class)


register_rollout_plugin("harness", _HarnessPlugin())
