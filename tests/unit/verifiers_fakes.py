"""Fakes for the verifiers env-server client: episodes shaped as verifiers 0.4 sends them, and a
fake env server speaking its ZMQ protocol (ROUTER socket, msgpack, ``delta`` frames then one
``reply``) on an ipc:// socket, for tests/unit/test_verifiers_envs.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio


def node(
    token_ids: list[int],
    *,
    parent: int | None,
    role: str = "user",
    content: str = "",
    sampled_from: int | None = None,
    logprobs: list[float] | None = None,
    links: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A message node; `sampled_from`: index in `token_ids` where the sampled completion starts."""
    sampled = sampled_from is not None
    mask = [sampled and i >= (sampled_from or 0) for i in range(len(token_ids))]
    return {
        "parent": parent,
        "message": {"role": role, "content": content},
        "sampled": sampled,
        "token_ids": token_ids,
        "mask": mask,
        "logprobs": logprobs if logprobs is not None else [-0.5] * sum(mask),
        "semantic_parents": links or [],
    }


def trace(nodes: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "version": 1,
        "id": fields.pop("id", "t0"),
        "task": {"type": "Task", "data": {"prompt": "q"}},
        "agent": {"config": {}, "name": "agent", "trainable": True},
        "nodes": nodes,
        "calls": [{"node": i, "finish_reason": "stop"} for i, n in enumerate(nodes) if n["sampled"]],
        "errors": [],
        "rewards": {"correct": {"score": 1.0, "weight": 1.0}},
        "metrics": {"turns": 2.0},
        "is_completed": True,
        "ok": True,
        "stop_condition": "agent_completed",
    }
    base.update(fields)
    return base


def two_turn_episode(**trace_fields: Any) -> dict[str, Any]:
    """system+user (5 ids), assistant (2 scaffold + 3 sampled), tool result (4), assistant (1 + 2)."""
    nodes = [
        node([1, 2, 3, 4, 5], parent=None, content="question"),
        node(
            [6, 7, 10, 11, 12],
            parent=0,
            role="assistant",
            content="call",
            sampled_from=2,
            logprobs=[-0.1, -0.2, -0.3],
        ),
        node([13, 14, 15, 16], parent=1, role="tool", content="42"),
        node(
            [6, 7, 20, 21],
            parent=2,
            role="assistant",
            content="answer",
            sampled_from=2,
            logprobs=[-0.4, -0.5],
        ),
    ]
    return {"id": "ep1", "ok": True, "errors": [], "traces": [trace(nodes, **trace_fields)]}


Handler = Callable[[bytes, bytes, dict[str, Any]], list[list[bytes]]]


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


def episode_frames(request_id: bytes, episode: dict[str, Any]) -> list[list[bytes]]:
    """How the env server streams `episode`: one delta per trace (header, then nodes, calls and
    fields), a second delta adding the rewards, then the reply with the head and trace counts."""
    frames = []
    for tr in episode["traces"]:
        header = {k: tr[k] for k in ("version", "id", "task")}
        first = {"trace": tr["id"], "open": header, "nodes": tr["nodes"][:1], "calls": []}
        rest = {
            "trace": tr["id"],
            "nodes": tr["nodes"][1:],
            "calls": tr["calls"],
            "errors": tr["errors"],
            "set": {
                k: v for k, v in tr.items() if k not in ("version", "id", "task", "nodes", "calls", "errors")
            },
        }
        frames += [[request_id, b"delta", pack(first)], [request_id, b"delta", pack(rest)]]
    head = {k: v for k, v in episode.items() if k != "traces"}
    summaries = [
        {"id": t["id"], "nodes": len(t["nodes"]), "calls": len(t["calls"])} for t in episode["traces"]
    ]
    reply = {"success": True, "error": None, "head": head, "traces": summaries}
    frames.append([request_id, b"reply", pack(reply)])
    return frames


class FakeEnvServer:
    """A ROUTER socket at `address` answering ``health`` and handing ``run`` to `on_run`, which
    returns the frames (``[request_id, kind, data]``) to send back. Records every request."""

    def __init__(self, address: str, on_run: Handler) -> None:
        self.address, self.on_run = address, on_run
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeEnvServer:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.socket.close(linger=0)
        self.context.term()

    async def _serve(self) -> None:
        while True:
            client, request_id, method, payload = await self.socket.recv_multipart()
            body = msgpack.unpackb(payload, raw=False)
            self.requests.append((method.decode(), body))
            if method == b"health":
                out = [[request_id, b"reply", pack({"success": True, "error": None})]]
            elif method == b"run":
                out = self.on_run(request_id, method, body)
            else:
                out = []
            for frames in out:
                await self.socket.send_multipart([client, *frames])
