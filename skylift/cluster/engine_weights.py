"""Which weights the inference engines hold, and pushing new ones, with failover.

`EngineWeights` is the driver's view of the engines' weights. With ``weight_sync_backend=delta``
there is no group: the policy publishes a version to a shared directory and every live engine
applies and loads it (`_delta_sync`). The weight-update group
(`PolicySync`: the policy broadcasts, the driver tells the engines to receive) is built over the
pool's live engines at start and rebuilt whenever the pool's live set no longer matches the group's
members (the pool alone decides which engines are alive); a failed broadcast probes the engines
and is retried once. It also tracks the policy version the engines hold and whether colocated
engines sleep (their memory freed for training).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from skylift.cluster.policy_sync import PolicySync
from skylift.cluster.settings import lora_sync_path
from skylift.cluster.worker_group import WorkerGroup
from skylift.config.schema import SkyliftConfig
from skylift.config.validation import overrides_update_group
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.weight_sync.protocol import DeltaPublishSpec, DeltaSyncRequest


class EngineWeights:
    """The engines' copy of the policy: `version` is the policy version they hold."""

    def __init__(
        self,
        cfg: SkyliftConfig,
        policy: WorkerGroup,
        engines: EnginePool,
        run: Callable,
        say: Callable[[str], None],
    ) -> None:
        g = cfg.generator
        self.engines = engines
        self.run, self.say = run, say
        self.dtype = None if g.model_dtype == "auto" else g.model_dtype  # None: sent as trained
        self.policy = policy
        d = g.delta_weight_sync
        #: weight_sync_backend=delta: where the policy publishes (None: a weight-update group)
        self.delta = (
            DeltaPublishSpec(
                d.sync_dir,
                int(d.max_file_size_in_gb * (1 << 30)),
                d.publish_num_workers,
                d.publish_staging_dir,
                d.rebase_interval,
            )
            if g.weight_sync_backend == "delta" and d.sync_dir
            else None
        )
        self.delta_store_dir = d.local_checkpoint_dir  # each engine host's store (None: derived)
        self.delta_download_workers = d.cloud_download_workers  # an s3:// or gs:// sync_dir's
        self.link = PolicySync(
            policy,
            lora=cfg.trainer.policy.model.lora.rank > 0,
            backend=None if g.weight_sync_backend in ("auto", "delta") else g.weight_sync_backend,
            timeout_s=g.weight_sync_timeout_s,
            # None: derived on the policy's rank 0 (see RLWorker.host_weight_group)
            master_address=g.weight_sync_master_address,
        )
        self.override_existing = overrides_update_group(g.override_existing_update_group)
        # a LoRA policy's adapter goes through this directory instead of the group (None: in memory)
        self.lora_sync_path = lora_sync_path(cfg)
        # a LoRA sync loads the adapter under a new name, and vLLM keys cached blocks by that name
        # (base-model blocks stay valid): no cached prefix is stale, so no reset after it
        self.reset_prefix_cache = cfg.trainer.policy.model.lora.rank <= 0
        self.version = 0
        self.asleep = False
        fa = cfg.trainer.fully_async
        #: fully async: generation runs during syncs, so the engines pause for each (None: they idle)
        self.pause_mode = fa.pause_mode if fa.enabled else None
        self._broken = False  # a broadcast failed: the group must be rebuilt before the next

    def open(self) -> None:
        """The weight-update group policy rank 0 -> every engine (delta sync: none)."""
        if self.delta is not None:
            self.say(f"weight sync: delta versions under {self.delta.sync_dir}")
            return
        address = self.run(self.link.open(self.engines.engines, self.override_existing))
        self.say(f"weight sync: {len(self.engines.engines)} engine(s) dial {address}")

    def sleep(self) -> None:
        """Free the engines' memory for training (colocated engines on GPUs)."""
        self.run(self.engines.sleep())
        self.asleep = True

    def sync(self, policy_version: int) -> None:
        """Push the policy's weights (of `policy_version`) to every live engine.

        Engines that failed since the weight-update group was built are left out of a new group
        first. A failed broadcast probes the engines, rebuilds the group with those that answer
        and retries once. With no engine left nothing is sent: the step still completes (its
        update is applied) and the next generation stops training with a checkpoint.
        """
        if self.asleep:  # colocated on GPU: weights must be resident to be overwritten
            self.run(self.engines.wake_up())
            self.asleep = False
        if self.delta is not None:
            self._delta_sync(policy_version)
        elif self.pause_mode is None or not self.engines.live_indices:
            self._broadcast()
        else:  # requests in flight: no engine may sample while its weights change
            self._paused(self.pause_mode, policy_version, self._broadcast_and_reset)
        self.version = policy_version

    def _broadcast_and_reset(self) -> None:
        self._broadcast()
        if self.reset_prefix_cache:  # full weights: every cached block is stale
            self.run(self.engines.reset_prefix_cache())

    def _delta_sync(self, policy_version: int) -> None:
        """The policy publishes its next delta version; every live engine applies it to its host's
        store while it still generates, then loads what changed (paused when requests are in
        flight) and resets its prefix cache. Unavailable engines are taken out by the pool; with
        none left nothing is loaded (the step still completes, as with a group)."""
        assert self.delta is not None
        metrics = self.run(asyncio.to_thread(self.policy.publish_delta, self.delta, self.dtype))
        request = DeltaSyncRequest(
            int(metrics["weight_sync/delta_version"]),
            self.delta.sync_dir,
            self.delta_store_dir,
            self.delta_download_workers,
        )
        try:
            self.run(self.engines.fetch_delta(request))
            if self.pause_mode is None:
                self.run(self.engines.load_delta(request))
            else:
                self._paused(
                    self.pause_mode, policy_version, lambda: self.run(self.engines.load_delta(request))
                )
        except NoHealthyEngineError as exc:
            self.say(f"delta version {request.version} published, loaded by no engine: {exc}")

    def _paused(self, mode: str, policy_version: int, update: Callable[[], None]) -> None:
        """Pause the engines (requests in flight kept or aborted), `update` them, resume them
        labelling what they sample from now on with `policy_version`."""
        self.run(self.engines.pause_generation(mode))  # type: ignore[arg-type]
        try:
            update()
        except BaseException:
            try:  # let the engines go on with what they hold; the sync's error is the one raised
                self.run(self.engines.resume_generation(self.version))
            except Exception as exc:  # noqa: BLE001
                self.say(f"resuming the engines after a failed sync: {type(exc).__name__}: {exc}")
            raise
        self.run(self.engines.resume_generation(policy_version))

    def label(self) -> None:
        """Tell the engines the version they hold, so that they label the tokens they sample."""
        self.run(self.engines.resume_generation(self.version))

    def _live_engines(self) -> list[Any]:
        return [self.engines.engines[i] for i in self.engines.live_indices]

    def _broadcast(self) -> None:
        from skylift.weight_sync import WeightSyncError

        for attempt in (1, 2):
            stale = self._broken or self.link.group is None or self.link.members != self._live_engines()
            if stale and not self._rebuild():
                return
            try:
                self.run(self.link.push(self.dtype, self.lora_sync_path))
                break
            except WeightSyncError as exc:
                if attempt == 2:
                    raise
                self.say(f"weight sync failed ({exc}); checking the engines and retrying once")
                self.run(self.engines.probe())
                self._broken = True  # a new group (or none, when no engine answers)

    def _rebuild(self) -> bool:
        """A weight-update group of the pool's live engines only; False when none is left. The
        old group is destroyed first (dead engines failing to answer are logged) and the live
        engines replace their membership."""
        self.run(self.link.close())
        self._broken = False
        live = self._live_engines()
        if not live:
            return False
        self.say(
            f"rebuilding the weight-update group with {len(live)} live engine(s) of {len(self.engines.engines)}"
        )
        self.run(self.link.open(live, override_existing=True))
        return True

    def close(self) -> None:
        """Destroy the weight-update group (engines first, then the policy's rank 0)."""
        if self.delta is not None:
            return
        self.run(self.link.close())
