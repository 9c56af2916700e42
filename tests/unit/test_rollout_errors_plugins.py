"""Rollouts that do not go through skylift's `Generator` (the harness plugin's agent programs, the
verifiers env server) mark their failures on the user's input with the prompt's uid, so that
training stops on one line (`rollout_input`); the agent's own failures stay a failed trajectory,
and an env server that cannot be reached keeps its traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer, token_ids
from verifiers_fakes import FakeEnvServer, pack, two_turn_episode

from skylift.data import PromptSample
from skylift.gateway.rollouts import HarnessRollouts, HarnessSettings
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.chat import ChatTemplateError
from skylift.generator.rollout_errors import PromptTooLongError, rollout_input
from skylift.inference.types import SamplingParams
from skylift.integrations.verifiers.episodes import EpisodeFailed
from skylift.integrations.verifiers.rollouts import (
    EpisodeLimits,
    TaskError,
    VerifiersRollouts,
    VerifiersSettings,
)
from skylift.integrations.verifiers.wire import (
    EnvServerError,
    EnvServerRefused,
    EnvServerUnreachable,
    MalformedEpisode,
    VerifiersEnvClient,
)

# ------------------------------------------------------------------ the harness plugin

#: a template that refuses two user turns in a row (as many models' templates do)
STRICT = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _harness(tokenizer: Any, row: Row, replies: list[Reply], entrypoint: str) -> list[Any]:
    generator = Generator(
        ScriptedEngine(replies), tokenizer, GeneratorSettings(max_generate_length=64, max_prompt_length=512)
    )
    rollouts = HarnessRollouts(
        generator, HarnessSettings(entrypoint=entrypoint), default_env_class="calculator"
    )

    async def go() -> list[Any]:
        try:
            return await rollouts.generate([row], 1, SamplingParams(max_tokens=64), 0)
        finally:
            await rollouts.aclose()

    return asyncio.run(go())


def test_a_harness_row_the_chat_template_cannot_render_is_named() -> None:
    row = Row(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        "calculator",
        uid="agent.jsonl:4",
    )
    with pytest.raises(ChatTemplateError) as info:  # its stand-in prompt: the agent made no call
        _harness(chatml_tokenizer(STRICT), row, [], "gateway_agents:crash_at_once")
    assert rollout_input(info.value) == (
        "prompt agent.jsonl:4: the chat template cannot render the messages (roles ['user', 'user']): "
        "TemplateError: Conversation roles must alternate user/assistant/user/assistant/..."
    )


def test_a_crashing_agent_is_still_a_failed_trajectory_not_a_stop() -> None:
    tokenizer = chatml_tokenizer()
    row = Row([{"role": "user", "content": "What is 17 * 24?"}], "calculator", uid="agent.jsonl:5")
    replies = [Reply(token_ids(tokenizer, "hello") + [tokenizer.eos_token_id])]
    (trajectory,) = _harness(tokenizer, row, replies, "gateway_agents:crash_after_one_call")
    assert trajectory.reward == 0.0 and "the agent fell over" in trajectory.env_metadata["harness_error"]


# ------------------------------------------------------------------ verifiers


class _Client:
    """The env server's client, answering every run with `answer` (an episode, or an exception)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def run(self, task: Any, client: Any, model: str, sampling: Any) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def close(self) -> None:
        pass


def _verifiers(client: Any, row: PromptSample, max_prompt_length: int = 64) -> Any:
    gen = VerifiersRollouts(
        None,
        ["127.0.0.1:1"],
        VerifiersSettings(address="tcp://127.0.0.1:1", model="m"),
        EpisodeLimits(max_prompt_length, 8),
        default_env_class="verifiers",
        renderer_model="x",
        client=client,
    )

    async def go() -> Any:
        try:
            return await gen.generate([row], 1, SamplingParams())
        finally:
            await gen.aclose()

    return asyncio.run(go())


def _row(uid: str, extra: dict[str, Any] | None = None) -> PromptSample:
    return PromptSample([{"role": "user", "content": "q"}], "verifiers", {}, extra or {}, "ds", uid)


def _line(kind: type[BaseException], client: Any, row: PromptSample, **kw: Any) -> str | None:
    with pytest.raises(kind) as info:
        _verifiers(client, row, **kw)
    return rollout_input(info.value)


def test_a_failed_verifiers_episode_is_named_with_its_prompt() -> None:
    failed = {
        **two_turn_episode(),
        "ok": False,
        "errors": [{"type": "SandboxError", "message": "runtime died"}],
    }
    line = _line(EpisodeFailed, _Client(failed), _row("v.jsonl:2"))
    assert line == "verifiers episode ep1 of prompt v.jsonl:2 failed: SandboxError: runtime died"


def test_a_task_that_is_not_a_mapping_is_named() -> None:
    line = _line(TaskError, _Client(two_turn_episode()), _row("v.jsonl:0", {"verifiers_task": "x"}))
    assert line == (
        "prompt v.jsonl:0: extra_info['verifiers_task'] must be a mapping of the taskset's task fields, got str"
    )


def test_an_episode_without_token_ids_is_named() -> None:
    episode = two_turn_episode()
    for node in episode["traces"][0]["nodes"]:
        node.pop("token_ids", None)
    line = _line(MalformedEpisode, _Client(episode), _row("v.jsonl:1"))
    assert line is not None and line.startswith("prompt v.jsonl:1: ")


def test_a_verifiers_prompt_past_the_limit_is_a_prompt_too_long() -> None:
    line = _line(PromptTooLongError, _Client(two_turn_episode()), _row("v.jsonl:3"), max_prompt_length=6)
    assert line == (
        "verifiers episode ep1 of prompt v.jsonl:3: the prompt has 7 tokens, more than trainer.max_prompt_length=6"
    )


def test_a_run_the_env_server_refuses_is_named(tmp_path: Path) -> None:
    def refuse(request_id: bytes, _m: bytes, _b: Any) -> list[list[bytes]]:
        return [[request_id, b"reply", pack({"success": False, "error": "ValidationError: prompt missing"})]]

    address = f"ipc://{tmp_path}/env.sock"

    async def main() -> None:
        async with FakeEnvServer(address, refuse):
            await asyncio.to_thread(_verifiers, VerifiersEnvClient(address), _row("v.jsonl:7"))

    with pytest.raises(EnvServerRefused) as info:
        asyncio.run(main())
    assert rollout_input(info.value) == (
        f"prompt v.jsonl:7: verifiers env server at {address}: run failed: ValidationError: prompt missing"
    )


@pytest.mark.parametrize(
    "exc", [EnvServerUnreachable("no env server at tcp://x:1"), EnvServerError("took longer than 900 s")]
)
def test_an_env_server_that_is_gone_or_slow_is_not_the_users_input(exc: Exception) -> None:
    assert _line(type(exc), _Client(exc), _row("v.jsonl:8")) is None
