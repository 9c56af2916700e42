"""verifiers 0.4 env-server rollouts without verifiers: episodes to trajectories (exact ids, mask,
logprobs, rewards), the ZMQ client against a fake env server on an ipc:// socket (deltas, replies,
errors, timeouts, an unreachable server), and the generator that routes rows to it."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
from verifiers_fakes import FakeEnvServer, episode_frames, node, pack, trace, two_turn_episode

from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.inference.types import SamplingParams
from skylift.integrations.verifiers.episodes import EpisodeFailed, episode_trajectories
from skylift.integrations.verifiers.rollouts import EpisodeLimits, VerifiersRollouts, VerifiersSettings
from skylift.integrations.verifiers.wire import (
    EnvServerError,
    EnvServerUnreachable,
    MalformedEpisode,
    VerifiersEnvClient,
)

# ------------------------------------------------------------------ episodes -> trajectories


def test_two_turn_episode_keeps_sampled_ids_logprobs_and_mask() -> None:
    (tr,) = episode_trajectories(two_turn_episode(), "p0", data_source="ds", policy_version=3)
    assert tr.prompt_ids == [1, 2, 3, 4, 5, 6, 7]  # the first assistant node's scaffold is prompt
    assert tr.response_ids == [10, 11, 12, 13, 14, 15, 16, 6, 7, 20, 21]
    assert tr.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert tr.rollout_logprobs == [-0.1, -0.2, -0.3, 0, 0, 0, 0, 0, 0, -0.4, -0.5]
    assert tr.reward == 1.0 and tr.stop_reason == "stop" and tr.num_turns == 2
    assert tr.uid == "p0" and tr.data_source == "ds" and tr.policy_version == 3
    assert tr.metrics == {"turns": 2.0} and tr.response_text == "call\nanswer"
    assert tr.env_metadata["verifiers_episode"] == "ep1"


def test_rewards_are_weighted_and_unscored_ones_skipped() -> None:
    rewards = {"a": {"score": 0.5, "weight": 2.0}, "b": {"score": 1.0, "weight": -0.5}, "c": None}
    (tr,) = episode_trajectories(two_turn_episode(rewards=rewards), "p0")
    assert tr.reward == pytest.approx(0.5)


def test_each_branch_is_a_sample_and_dropped_compaction_attempts_are_not() -> None:
    nodes = [
        node([1, 2], parent=None),
        node([3, 4], parent=0, role="assistant", sampled_from=0),
        node([5, 6], parent=0, role="assistant", sampled_from=1),  # a second context from node 0
        node(
            [7], parent=0, role="assistant", sampled_from=0, links=[{"node": 1, "type": "compaction_attempt"}]
        ),
    ]
    episode = {"id": "e", "ok": True, "errors": [], "traces": [trace(nodes)]}
    out = episode_trajectories(episode, "p")
    assert [(t.prompt_ids, t.response_ids, t.loss_mask) for t in out] == [
        ([1, 2], [3, 4], [1, 1]),
        ([1, 2, 5], [6], [1]),
    ]


def test_untrainable_agents_are_skipped() -> None:
    episode = two_turn_episode()
    helper = copy.deepcopy(episode["traces"][0])
    helper["id"], helper["agent"]["trainable"] = "judge", False
    episode["traces"].append(helper)
    assert len(episode_trajectories(episode, "p")) == 1


def test_truncation_follows_the_run_settings() -> None:
    episode = two_turn_episode(stop_condition="max_turns")
    (tr,) = episode_trajectories(episode, "p")
    assert tr.stop_reason == "length" and tr.reward == 1.0
    (tr,) = episode_trajectories(episode, "p", zero_reward_on_non_stop=True, apply_overlong_filtering=True)
    assert tr.reward == 0.0 and sum(tr.loss_mask) == 0
    last_call_length = two_turn_episode()
    last_call_length["traces"][0]["calls"][-1]["finish_reason"] = "length"
    assert episode_trajectories(last_call_length, "p")[0].stop_reason == "length"


def test_failed_episode_raises_with_the_servers_errors() -> None:
    episode = two_turn_episode()
    episode["ok"] = False
    episode["errors"] = [{"type": "SandboxError", "message": "runtime died"}]
    with pytest.raises(EpisodeFailed, match="ep1 of prompt p failed: SandboxError: runtime died"):
        episode_trajectories(episode, "p")
    trace_error = two_turn_episode(ok=False, errors=[{"type": "ProviderError", "message": "HTTP 400"}])
    with pytest.raises(EpisodeFailed, match="ProviderError: HTTP 400"):
        episode_trajectories(trace_error, "p")
    retried = two_turn_episode()  # a retried episode keeps its earlier attempts' errors
    retried["errors"] = [{"type": "SandboxError", "message": "first attempt"}]
    assert episode_trajectories(retried, "p")[0].reward == 1.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e.pop("traces"), "'traces' must be a list"),
        (lambda e: e["traces"][0]["nodes"][1].update(token_ids=[], mask=[], logprobs=[]), "'train' client"),
        (lambda e: e["traces"][0]["nodes"][1].update(mask=[True]), "'mask' has 1 entries for 5 token ids"),
        (lambda e: e["traces"][0]["nodes"][1].update(logprobs=[-1.0]), "1 logprobs for 3 sampled tokens"),
        (lambda e: e["traces"][0]["nodes"][1].update(token_ids=[6, 7, "x", 11, 12]), "list of integers"),
        (lambda e: e["traces"][0]["nodes"][2].update(parent=3), "parent 3, not an earlier node"),
        (lambda e: e["traces"][0].update(rewards={"r": {"value": 1}}), "reward 'r' has no numeric 'score'"),
        (lambda e: e["traces"][0]["nodes"][0].update(mask=[True] * 5, logprobs=[0.0] * 5), "no prompt"),
        (lambda e: e["traces"][0].update(nodes=[]), "no trainable sampled tokens"),
    ],
)
def test_malformed_episodes_are_refused_with_what_is_wrong(change: Any, message: str) -> None:
    episode = two_turn_episode()
    change(episode)
    with pytest.raises(MalformedEpisode, match=message):
        episode_trajectories(episode, "p")


def test_an_overlong_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="7 tokens, more than trainer.max_prompt_length=6"):
        episode_trajectories(two_turn_episode(), "p", max_prompt_length=6)


# ------------------------------------------------------------------ the client and a fake server


def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/env.sock"


def serving(episode: dict[str, Any]) -> Any:
    return lambda request_id, _method, _body: episode_frames(request_id, episode)


async def run_one(client: VerifiersEnvClient) -> dict[str, Any]:
    try:
        return await client.run({"prompt": "q"}, {"type": "train"}, "m", {"max_tokens": 4})
    finally:
        await client.close()


def test_client_assembles_the_streamed_episode(tmp_path: Path) -> None:
    async def main() -> tuple[dict[str, Any], list[Any]]:
        async with FakeEnvServer(address(tmp_path), serving(two_turn_episode())) as server:
            episode = await run_one(VerifiersEnvClient(address(tmp_path), health_timeout_s=5))
            return episode, server.requests

    episode, requests = asyncio.run(main())
    assert [m for m, _ in requests] == ["health", "run"]
    assert requests[1][1] == {"task_data": {"prompt": "q"}, "client": {"type": "train"}, "model": "m",
                              "sampling": {"max_tokens": 4}}  # fmt: skip
    expected = two_turn_episode()
    assert episode["traces"][0]["nodes"] == expected["traces"][0]["nodes"]
    assert episode["traces"][0]["rewards"] == expected["traces"][0]["rewards"]
    assert episode_trajectories(episode, "p")[0].response_ids == [10, 11, 12, 13, 14, 15, 16, 6, 7, 20, 21]


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    client = VerifiersEnvClient(address(tmp_path), health_timeout_s=0.3)
    with pytest.raises(EnvServerUnreachable, match="no verifiers env server answered at ipc://.* within 0 s"):
        asyncio.run(run_one(client))


def test_server_side_failure_is_raised_with_its_message(tmp_path: Path) -> None:
    def fail(request_id: bytes, _m: bytes, _b: Any) -> list[list[bytes]]:
        return [[request_id, b"reply", pack({"success": False, "error": "ValidationError: prompt missing"})]]

    async def main() -> None:
        async with FakeEnvServer(address(tmp_path), fail):
            await run_one(VerifiersEnvClient(address(tmp_path)))

    with pytest.raises(EnvServerError, match="run failed: ValidationError: prompt missing"):
        asyncio.run(main())


def _bad_counts(request_id: bytes, _m: bytes, _b: Any) -> list[list[bytes]]:
    frames = episode_frames(request_id, two_turn_episode())
    frames[-1][2] = pack(
        {"success": True, "head": {"id": "e"}, "traces": [{"id": "t0", "nodes": 9, "calls": 2}]}
    )
    return frames


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (lambda rid, m, b: [[rid, b"reply", b"\xc1not msgpack"]], "not msgpack"),
        (lambda rid, m, b: [[rid, b"reply", pack([1, 2])]], "is not {success, error, ...}"),
        (lambda rid, m, b: [[rid, b"delta", pack({"trace": "t0", "nodes": []})]], "has no 'open' header"),
        (lambda rid, m, b: [[rid, b"weird", pack({})]], "unknown frame kind"),
        (
            lambda rid, m, b: [[rid, b"delta", pack({"trace": "t", "open": {}, "links": [1]})]],
            "AttributeError",
        ),
        (
            lambda rid, m, b: [[rid, b"reply", pack({"success": True, "head": None, "traces": []})]],
            "no episode head",
        ),
        (_bad_counts, "assembled 4 nodes / 2 calls, the server reports 9 / 2"),
    ],
)
def test_malformed_frames_fail_the_request(tmp_path: Path, handler: Any, message: str) -> None:
    async def main() -> None:
        async with FakeEnvServer(address(tmp_path), handler):
            await run_one(VerifiersEnvClient(address(tmp_path)))

    with pytest.raises(MalformedEpisode, match=message):
        asyncio.run(main())


def test_a_slow_episode_times_out_and_is_cancelled_on_the_server(tmp_path: Path) -> None:
    async def main() -> list[Any]:
        async with FakeEnvServer(address(tmp_path), lambda *_: []) as server:
            with pytest.raises(EnvServerError, match="longer than environment.verifiers.run_timeout_s"):
                await run_one(VerifiersEnvClient(address(tmp_path), run_timeout_s=0.3))
            await asyncio.sleep(0.2)
            return server.requests

    requests = asyncio.run(main())
    assert [m for m, _ in requests] == ["health", "run", "cancel"]
    assert isinstance(requests[2][1]["request_id"], str)


def test_client_refuses_an_address_without_a_scheme() -> None:
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        VerifiersEnvClient("127.0.0.1:5000")


# ------------------------------------------------------------------ settings and the generator


def test_settings_are_checked() -> None:
    assert VerifiersSettings.from_options({}) is None
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['adress'\]"):
        VerifiersSettings.from_options({"adress": "tcp://x:1"})
    with pytest.raises(ValueError, match="set it to the env server's address"):
        VerifiersSettings.from_options({"model": "m"})
    with pytest.raises(ValueError, match="run_timeout_s must be > 0"):
        VerifiersSettings.from_options({"address": "tcp://x:1", "run_timeout_s": 0})


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], dict[str, Any], str, dict[str, Any]]] = []

    async def run(
        self, task: dict[str, Any], client: dict[str, Any], model: str, sampling: dict[str, Any]
    ) -> Any:
        self.calls.append((task, client, model, sampling))
        return two_turn_episode()

    async def close(self) -> None:
        pass


class FakeInner:
    async def generate(self, rows: Any, n: int, params: Any, version: int, seeds: Any) -> list[Trajectory]:
        return [
            Trajectory(
                uid=row.uid,
                prompt_ids=[1],
                response_ids=[2],
                loss_mask=[1],
                rollout_logprobs=[0.0],
                reward=0.5,
                stop_reason="stop",
            )  # fmt: skip
            for row in rows
            for _ in range(n)
        ]


def row(uid: str, env_class: str, extra: dict[str, Any] | None = None) -> PromptSample:
    return PromptSample([{"role": "user", "content": f"q{uid}"}], env_class, {}, extra or {}, "ds", uid)


def test_generator_routes_verifiers_rows_to_the_env_server() -> None:
    fake = FakeClient()
    settings = VerifiersSettings(address="tcp://127.0.0.1:1", model="tiny", sampling={"top_k": 5})
    gen = VerifiersRollouts(
        FakeInner(),
        ["127.0.0.1:8001", "http://127.0.0.1:8002/"],
        settings,
        EpisodeLimits(max_prompt_length=64, max_generate_length=8),
        default_env_class="verifiers",
        renderer_model="/models/tiny",
        client=fake,  # type: ignore[arg-type]
    )
    rows = [
        row("a", ""),
        row("b", "gsm8k"),
        row("c", "verifiers", {"verifiers_task": {"prompt": "x", "answer": 3}}),
    ]
    params = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=100)
    out = asyncio.run(gen.generate(rows, 2, params, policy_version=4, seeds=[10, 20, 30]))
    assert [t.uid for t in out] == ["a", "a", "b", "b", "c", "c"]
    assert [t.reward for t in out] == [1.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert out[0].policy_version == 4
    tasks = [c[0] for c in fake.calls]
    assert tasks == [{"prompt": [{"role": "user", "content": "qa"}]}] * 2 + [{"prompt": "x", "answer": 3}] * 2
    assert [c[1]["base_url"] for c in fake.calls] == [
        "http://127.0.0.1:8001/v1",
        "http://127.0.0.1:8002/v1",
    ] * 2
    assert fake.calls[0][1]["type"] == "train" and fake.calls[0][1]["renderer_model_name"] == "/models/tiny"
    assert {c[2] for c in fake.calls} == {"tiny"}
    assert [c[3] for c in fake.calls[:2]] == [
        {"temperature": 0.9, "top_p": 0.8, "max_tokens": 8, "seed": 10, "top_k": 5},
        {"temperature": 0.9, "top_p": 0.8, "max_tokens": 8, "seed": 11, "top_k": 5},
    ]


def test_generator_needs_remote_engines_and_mapping_tasks() -> None:
    settings = VerifiersSettings(address="tcp://127.0.0.1:1", model="m")
    limits = EpisodeLimits(64, 8)
    with pytest.raises(ValueError, match="skylift serve --enable-scale-out"):
        VerifiersRollouts(None, [], settings, limits, default_env_class="verifiers", renderer_model="x")
    gen = VerifiersRollouts(
        None, ["127.0.0.1:1"], settings, limits, default_env_class="verifiers", renderer_model="x",
        client=FakeClient(),  # type: ignore[arg-type]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"extra_info\['verifiers_task'\] must be a mapping"):
        asyncio.run(gen.generate([row("a", "verifiers", {"verifiers_task": "x"})], 1, SamplingParams()))
    with pytest.raises(ValueError, match="only verifiers rows"):
        asyncio.run(gen.generate([row("a", "gsm8k")], 1, SamplingParams()))
