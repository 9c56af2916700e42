"""A verifiers 0.4 taskset (v1 API) for tests/integration/test_ecosystem_envs.py, served by
verifiers' own env server (tests/integration/verifiers_server.py).

Its task rewards a last reply of even length (random for the untrained tiny model, so GRPO groups
get non-zero advantages). Its harness plays two chat turns in-process (verifiers allows a harness
that runs its loop itself, as long as every model call goes through the interception endpoint):
the env server samples both through the engine's /inference/v1/generate and records the tokens.
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf


class EvenData(vf.TaskData):
    pass


class EvenTask(vf.Task[EvenData]):
    @vf.reward(weight=1.0)
    async def even_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) % 2 == 0)


class EvenConfig(vf.TasksetConfig):
    pass


class EvenTaskset(vf.Taskset[EvenTask, EvenConfig]):
    def load(self) -> list[EvenTask]:
        return [EvenTask(EvenData(prompt="Say something."), self.config.task)]


class TwoTurnChatConfig(vf.HarnessConfig):
    pass


class TwoTurnChat(vf.Harness[TwoTurnChatConfig]):
    """Asks the model, then says "Again." and asks once more."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        **_: Any,
    ) -> vf.ProgramResult:
        prompt = data.prompt
        if isinstance(prompt, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        else:
            messages = [{"role": m.role, "content": m.content} for m in prompt or []]
        async with httpx.AsyncClient(timeout=120.0) as client:
            for turn in range(2):
                response = await client.post(
                    endpoint.rstrip("/") + "/chat/completions",
                    headers={"Authorization": f"Bearer {secret}"},
                    json={"model": ctx.model, "messages": messages},
                )
                if response.status_code != 200:  # the interception's message names the cause
                    raise RuntimeError(f"model call: HTTP {response.status_code}: {response.text[:2000]}")
                reply = response.json()["choices"][0]["message"].get("content") or ""
                messages.append({"role": "assistant", "content": reply})
                if turn == 0:
                    messages.append({"role": "user", "content": "Again."})
        return vf.ProgramResult(0, "", "")


__all__ = ["EvenTaskset", "TwoTurnChat"]
