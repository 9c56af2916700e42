"""Which weights the inference engines hold, and pushing new ones.

`EngineWeights` is the driver's view of the engines' copy of the policy: the version they hold,
whether colocated engines sleep (their memory freed for training), and pausing them around a
sync while requests are in flight. How the weights travel is the `WeightTransport`'s
(`skylift.weight_sync.transport`: a broadcast over a weight-update group, a LoRA adapter, or
delta versions through a shared directory), picked from the config by `make_transport`
(`skylift.weight_sync.factory`).
"""

from __future__ import annotations

from collections.abc import Callable

from skylift.cluster.worker_group import WorkerGroup
from skylift.config.schema import SkyliftConfig
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.weight_sync.factory import make_transport
from skylift.weight_sync.transport import WeightTransport


class EngineWeights:
    """The engines' copy of the policy: `version` is the policy version they hold."""

    def __init__(
        self,
        cfg: SkyliftConfig,
        policy: WorkerGroup,
        engines: EnginePool,
        run: Callable,
        say: Callable[[str], None],
        lora_adapter: bool = True,
    ) -> None:
        """`lora_adapter`: a LoRA policy syncs its adapter (False: its merged weights;
        `skylift.cluster.lora_run`)."""
        self.engines = engines
        self.run, self.say = run, say
        self.transport: WeightTransport = make_transport(cfg, policy, engines, say, lora_adapter=lora_adapter)
        self.version = 0
        self.asleep = False
        fa = cfg.trainer.fully_async
        #: fully async: generation runs during syncs, so the engines pause for each (None: they idle)
        self.pause_mode = fa.pause_mode if fa.enabled else None

    def open(self) -> None:
        """Set the transport up for the pool's engines (a weight-update group, or nothing)."""
        self.say(self.run(self.transport.open()))

    def sleep(self) -> None:
        """Free the engines' memory for training (colocated engines on GPUs)."""
        self.run(self.engines.sleep())
        self.asleep = True

    def sync(self, policy_version: int) -> dict[str, float]:
        """Push the policy's weights (of `policy_version`) to every live engine; the sync's figures
        (`sync_metrics`: what the transport moved, how long its push took, which transport).

        The transport first stages what may overlap generation (a delta version published and
        fetched), then pushes; with requests in flight (fully async) the engines are paused
        around the push and their prefix caches reset when the new weights make them stale.
        Engines that failed are left out by the pool; with none left nothing is loaded: the step
        still completes (its update is applied) and the next generation stops training with a
        checkpoint (no figures).
        """
        if self.asleep:  # colocated on GPU: weights must be resident to be overwritten
            self.run(self.engines.wake_up())
            self.asleep = False
        pushed: dict[str, float] = {}
        try:
            self.run(self.transport.stage(policy_version))
            if self.pause_mode is None or not self.engines.live_indices:
                pushed = self.run(self.transport.push(policy_version))
            else:  # requests in flight: no engine may sample while its weights change
                self._paused(
                    self.pause_mode,
                    policy_version,
                    lambda: pushed.update(self._push_and_reset(policy_version)),
                )
        except NoHealthyEngineError as exc:
            self.say(f"weights of version {policy_version} published, loaded by no engine: {exc}")
        self.version = policy_version
        return sync_metrics(self.transport.name, pushed)

    def _push_and_reset(self, policy_version: int) -> dict[str, float]:
        pushed = self.run(self.transport.push(policy_version))
        if self.transport.needs_prefix_reset:
            self.run(self.engines.reset_prefix_cache())
        return pushed

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

    def close(self) -> None:
        """Close the transport (a weight-update group: engines first, then the policy's rank 0)."""
        self.run(self.transport.close())


def sync_metrics(transport: str, pushed: dict[str, float]) -> dict[str, float]:
    """A push's figures as a step's metrics: the transport's own keys (`weight_sync/bytes`, ...),
    its push time as `timing/weight_sync_push_s` (the step's `timing/weight_sync_s` is the driver's, the
    whole sync) and `weight_sync/via/<transport>` = 1 (trackers take numbers). A push that loaded
    nothing (no engine left, or a transport that returned no figures) gives nothing."""
    if not pushed:
        return {}
    out = {
        ("timing/weight_sync_push_s" if k == "timing/weight_sync_s" else k): float(v)
        for k, v in pushed.items()
    }
    out[f"weight_sync/via/{transport}"] = 1.0
    return out
