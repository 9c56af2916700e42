"""A client for verifiers' env server (verifiers 0.4, v1 API), written against its wire protocol.

The env server (``verifiers.v1.serve``: `serve_env` / `EnvServer`) holds a taskset and its
harness; each ``run`` request ships one task's data, the model endpoint to sample from and the
sampling settings, and the server plays the whole episode itself (its ``train`` client renders
the chat template and samples through the endpoint's ``/inference/v1/generate``). This module
speaks that protocol without importing verifiers:

- a ZMQ DEALER socket; a request is the frames ``[request_id, method, msgpack(payload)]``
  (methods ``health``, ``run``, ``cancel``);
- the server answers ``[request_id, kind, data]``: any number of ``delta`` frames (a run's traces,
  streamed turn by turn) then one ``reply`` (``{success, error, head, traces}``, where ``traces``
  lists each finished trace's id and node/call counts);
- the episode is the reply's ``head`` joined with the traces assembled from the deltas.

Every wait has a deadline (`EnvServerUnreachable` for an unanswered health probe,
`EnvServerError` for a timed-out run, which is then cancelled on the server, `EnvServerRefused`
for a run the server answered with its failure);
`MalformedEpisode` names what in a frame or an episode was not as the protocol says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)

#: Trace fields a delta appends to (the rest of a trace is sent once, or re-sent whole in ``set``).
LIST_FIELDS = ("nodes", "calls", "errors", "extra_usage", "request_rewrites", "response_rewrites")


class EnvServerError(RuntimeError):
    """The env server refused or failed a request, or gave no answer in time."""


class EnvServerUnreachable(EnvServerError):
    """No env server answered at the address."""


class EnvServerRefused(EnvServerError):
    """The env server answered a request with its failure (e.g. the taskset rejected the task or
    the environment raised before an episode): the user's side, not the connection."""


class MalformedEpisode(ValueError):
    """A frame or an episode that does not follow the env server's protocol."""


def _pack(payload: Any) -> bytes:
    import msgpack

    return bytes(msgpack.packb(payload, use_bin_type=True))


def _unpack(data: bytes, what: str) -> Any:
    import msgpack

    try:
        # node updates are keyed by node index (int)
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise MalformedEpisode(f"{what}: not msgpack ({type(exc).__name__}: {exc})") from exc


class EpisodeAssembly:
    """One run's traces, assembled from its ``delta`` frames as raw dicts."""

    def __init__(self) -> None:
        self.traces: dict[str, dict[str, Any]] = {}

    def apply(self, delta: Any) -> None:
        if not isinstance(delta, dict) or not isinstance(delta.get("trace"), str):
            raise MalformedEpisode(f"a delta must be a mapping with a 'trace' id, got {_brief(delta)}")
        trace_id = delta["trace"]
        if delta.get("discard"):  # a retried attempt abandons its traces
            self.traces.pop(trace_id, None)
            return
        trace = self.traces.get(trace_id)
        if trace is None:
            header = delta.get("open")
            if not isinstance(header, dict):
                raise MalformedEpisode(f"the first delta of trace {trace_id} has no 'open' header")
            trace = self.traces[trace_id] = {**header, **{name: [] for name in LIST_FIELDS}}
        for index, links in (delta.get("links") or {}).items():
            node = self._node(trace, trace_id, index)
            node.setdefault("semantic_parents", []).extend(links or [])
        # routed-expert repairs (MoE router replay) touch nothing skylift trains on: check the index
        for index in delta.get("routing_repairs") or {}:
            self._node(trace, trace_id, index)
        for name in LIST_FIELDS:
            items = delta.get(name)
            if items is None:
                continue
            if not isinstance(items, list):
                raise MalformedEpisode(f"trace {trace_id}: delta field {name!r} must be a list")
            if name == "nodes":
                items = [
                    {**node, "semantic_parents": list(node.get("semantic_parents") or [])} for node in items
                ]
            trace[name].extend(items)
        changed = delta.get("set") or {}
        if not isinstance(changed, dict):
            raise MalformedEpisode(f"trace {trace_id}: delta field 'set' must be a mapping")
        trace.update(changed)

    @staticmethod
    def _node(trace: dict[str, Any], trace_id: str, index: Any) -> dict[str, Any]:
        try:
            node = trace["nodes"][int(index)]
        except (ValueError, TypeError, IndexError) as exc:
            raise MalformedEpisode(
                f"trace {trace_id}: a delta names node {index!r}, which it never sent"
            ) from exc
        if not isinstance(node, dict):
            raise MalformedEpisode(f"trace {trace_id}: node {index} is not a mapping")
        return node

    def finish(self, head: Any, summaries: Any) -> dict[str, Any]:
        """The episode: `head` (the episode without its traces) and the assembled traces in the
        reply's order, each checked against the reply's node and call counts."""
        if not isinstance(head, dict):
            raise MalformedEpisode(f"the run's reply has no episode head (got {_brief(head)})")
        if not isinstance(summaries, list):
            raise MalformedEpisode("the run's reply has no list of traces")
        traces = []
        for summary in summaries:
            if not isinstance(summary, dict) or not isinstance(summary.get("id"), str):
                raise MalformedEpisode(
                    f"a trace summary must be a mapping with an 'id', got {_brief(summary)}"
                )
            trace = self.traces.get(summary["id"])
            if trace is None:
                raise MalformedEpisode(f"the reply lists trace {summary['id']}, which no delta opened")
            if len(trace["nodes"]) != summary.get("nodes") or len(trace["calls"]) != summary.get("calls"):
                raise MalformedEpisode(
                    f"trace {summary['id']}: assembled {len(trace['nodes'])} nodes / {len(trace['calls'])} "
                    f"calls, the server reports {summary.get('nodes')} / {summary.get('calls')}"
                )
            traces.append(trace)
        return {**head, "traces": traces}


def _brief(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class VerifiersEnvClient:
    """Requests to one env server at `address` (``tcp://host:port``), from one event loop.

    `health_timeout_s` bounds the probe `check` sends (once, before the first run);
    `run_timeout_s` bounds each episode (then it is cancelled on the server)."""

    def __init__(self, address: str, *, health_timeout_s: float = 30.0, run_timeout_s: float = 900.0) -> None:
        if not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"verifiers env server address {address!r}: expected tcp://HOST:PORT or ipc://PATH"
            )
        self.address = address
        self.health_timeout_s, self.run_timeout_s = health_timeout_s, run_timeout_s
        self._socket: Any = None
        self._context: Any = None
        self._receiver: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._assemblies: dict[str, EpisodeAssembly] = {}
        self._checked = False
        self._broken: Exception | None = None

    # ------------------------------------------------------------------ requests
    async def check(self) -> None:
        """Raise `EnvServerUnreachable` unless the server answers ``health`` in time (once)."""
        if self._checked:
            return
        try:
            await self._request("health", {}, self.health_timeout_s)
        except TimeoutError as exc:
            raise EnvServerUnreachable(
                f"no verifiers env server answered at {self.address} within {self.health_timeout_s:.0f} s "
                "(start one with verifiers' serve_env, and set environment.verifiers.address to its address)"
            ) from exc
        self._checked = True

    async def run(
        self, task_data: dict[str, Any], client: dict[str, Any], model: str, sampling: dict[str, Any]
    ) -> dict[str, Any]:
        """One episode of the task `task_data`, sampled from `client` (verifiers' ClientConfig
        fields) as `model` with `sampling`; the raw episode dict (head fields and ``traces``)."""
        await self.check()
        payload = {"task_data": task_data, "client": client, "model": model, "sampling": sampling}
        assembly = EpisodeAssembly()
        try:
            reply = await self._request("run", payload, self.run_timeout_s, assembly)
        except TimeoutError as exc:
            raise EnvServerError(
                f"verifiers env server at {self.address}: an episode took longer than "
                f"environment.verifiers.run_timeout_s={self.run_timeout_s:.0f} s (cancelled)"
            ) from exc
        return assembly.finish(reply.get("head"), reply.get("traces"))

    async def _request(
        self, method: str, payload: dict[str, Any], timeout_s: float, assembly: EpisodeAssembly | None = None
    ) -> dict[str, Any]:
        socket = self._ensure_socket()
        request_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        if assembly is not None:
            self._assemblies[request_id] = assembly
        try:
            await socket.send_multipart([request_id.encode(), method.encode(), _pack(payload)])
            data = await asyncio.wait_for(future, timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            if method == "run":  # the server stops the episode (best effort)
                with contextlib.suppress(Exception):
                    await socket.send_multipart(
                        [uuid.uuid4().hex.encode(), b"cancel", _pack({"request_id": request_id})]
                    )
            raise
        finally:
            self._pending.pop(request_id, None)
            self._assemblies.pop(request_id, None)
        reply = _unpack(data, f"verifiers env server at {self.address}: the reply to {method!r}")
        if not isinstance(reply, dict) or not isinstance(reply.get("success"), bool):
            raise MalformedEpisode(
                f"verifiers env server at {self.address}: the reply to {method!r} is not "
                f"{{success, error, ...}}: {_brief(reply)}"
            )
        if not reply["success"]:
            raise EnvServerRefused(
                f"verifiers env server at {self.address}: {method} failed: {reply.get('error') or 'no reason given'}"
            )
        return reply

    # ------------------------------------------------------------------ socket
    def _ensure_socket(self) -> Any:
        if self._broken is not None:
            raise EnvServerError(
                f"verifiers env server at {self.address}: the client stopped: {self._broken}"
            )
        if self._socket is None:
            import zmq
            import zmq.asyncio

            self._context = zmq.asyncio.Context()
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.address)
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        return self._socket

    async def _receive(self) -> None:
        """Route every incoming frame to its request; a malformed frame fails the request it names."""
        try:
            while True:
                frames = await self._socket.recv_multipart()
                if len(frames) != 3:
                    logger.warning("verifiers env server sent %d frames, expected 3; dropped", len(frames))
                    continue
                request_id, kind, data = (
                    bytes(frames[0]).decode(errors="replace"),
                    bytes(frames[1]),
                    frames[2],
                )
                future = self._pending.get(request_id)
                if future is None or future.done():
                    continue  # a request that timed out or was cancelled
                if kind == b"reply":
                    future.set_result(bytes(data))
                elif kind == b"delta":
                    assembly = self._assemblies.get(request_id)
                    try:
                        if assembly is None:
                            raise MalformedEpisode(f"a delta for request {request_id}, which is not a run")
                        assembly.apply(_unpack(bytes(data), "a delta frame"))
                    except Exception as exc:  # noqa: BLE001 - a delta of an unexpected shape fails its run
                        future.set_exception(
                            MalformedEpisode(
                                f"verifiers env server at {self.address}: a delta that does not follow the "
                                f"protocol ({type(exc).__name__}: {exc})"
                            )
                        )
                else:
                    future.set_exception(
                        MalformedEpisode(
                            f"verifiers env server at {self.address}: unknown frame kind {kind[:20]!r} "
                            "(expected 'delta' or 'reply': is it verifiers 0.4's env server?)"
                        )
                    )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the socket failed: every waiting request fails with it
            self._broken = exc
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(EnvServerError(f"verifiers env server at {self.address}: {exc}"))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._receiver
            self._receiver = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = self._context = None
        self._checked = False
