"""`Requests`: the one path every Tinker operation that answers with a future takes.

It holds the futures (`FutureHub`, made at `start`), one ordered queue per loaded training model,
the one training thread with its fair gate, and the background tasks. Each feature (training,
sampling, checkpoints, sessions) is handed this object and submits through it:

- `submit(kind, model_id, keys, prepare, queue_seq)` records a request and runs its work, at once
  in the background or on a model's ordered queue at its seq id;
- `run_training(fn, *args)` runs `fn` on the training thread in the calling user's turn;
- `db(fn, *args)` runs a blocking store call on a worker thread (the store is never touched on the
  event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from skylift.config.services import ServerConfig
from skylift.tinker.core.auth import current_user
from skylift.tinker.core.fairness import FairGate
from skylift.tinker.core.futures import FutureHub, OrderedQueue, Work
from skylift.tinker.storage.store import Store
from skylift.utils.affinity import bind_this_process, bind_this_thread

T = TypeVar("T")

#: prepare(request id) -> the work of a new request (it may raise: the request then fails with it)
Prepare = Callable[[str], Awaitable[Work]]


def confine_thread(cpus: list[int]) -> None:
    """Bind the calling thread to `cpus` and size torch's intra-op threads to them."""
    import torch

    bind_this_thread(cpus)
    torch.set_num_threads(len(cpus))


class Requests:
    """The futures, the models' ordered queues and the training thread; `start()` inside the
    serving event loop, `stop()` at shutdown."""

    def __init__(self, store: Store, config: ServerConfig) -> None:
        self.store, self.config = store, config
        self.queues: dict[str, OrderedQueue] = {}
        self._hub: FutureHub | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self.train_gate = FairGate(
            1, config.fair_wait_timeout_s, "the training thread", "--fair-wait-timeout-s"
        )
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        c = self.config
        self._hub = FutureHub(self.store, c.result_retention_s, c.future_max_age_s, c.max_pending_per_user)

    async def stop(self) -> None:
        for queue in self.queues.values():
            await queue.close()
        if self._hub is not None:
            await self._hub.close()
        for task in list(self._background):
            task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def hub(self) -> FutureHub:
        if self._hub is None:
            raise RuntimeError("service not started")
        return self._hub

    @property
    def started(self) -> bool:
        return self._hub is not None

    async def submit(
        self,
        kind: str,
        model_id: str | None,
        dedup_keys: Sequence[str | None],
        prepare: Prepare,
        queue_seq: int | None | bool = False,
    ) -> str:
        """Record a request and run it; returns its request id (a repeated POST gets the first id).

        `prepare(request_id)` runs now (it may register a model, validate, ...) and returns the work; an error
        it raises fails the request. With `queue_seq` an int or None the work runs on the model's
        ordered queue at that seq id; with False it runs at once in the background. A `prepare`
        that awaits nothing keeps the request's place: it is queued before this call returns
        control to the loop.
        """
        hub = self.hub
        request_id, new = hub.submit(kind, model_id, dedup_keys)
        if not new:
            return request_id
        try:
            work = await prepare(request_id)
        except Exception as exc:
            hub.fail(request_id, exc)
            await hub.persisted(request_id)
            return request_id
        if queue_seq is False:
            hub.start(request_id, work)
        else:
            queue = self.queues.get(str(model_id))
            if queue is None:
                hub.fail(request_id, RuntimeError(f"model {model_id} has no queue"))
            else:
                seq = None if queue_seq is None or queue_seq is True else int(queue_seq)
                self.spawn(queue.put(seq, lambda: hub.execute(request_id, work)))
        await hub.persisted(request_id)  # the reply names it: its record must survive a crash
        return request_id

    def fail_now(self, kind: str, exc: Exception) -> str:
        """A new future that fails with `exc` (a refused or broken operation)."""
        request_id, _ = self.hub.submit(kind, None)
        self.hub.fail(request_id, exc)
        return request_id

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a store call, or a function made of them) on a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def run_training(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the one training thread, when the calling user's turn comes (round robin
        between users, `skylift.tinker.core.fairness`)."""
        async with self.train_gate.slot(current_user.get()):
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def confine_server(self, cpus: list[int]) -> None:
        """Keep this process (the training thread, the HTTP loop, the database writer, and the
        engine's scheduler process started next) on `cpus`, torch's threads sized to them from the
        next operation on: the sampling side calls this before an engine takes the other cores."""
        bind_this_process(cpus)
        self._executor.submit(confine_thread, cpus)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro` in the background (cancelled at `stop`)."""
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
