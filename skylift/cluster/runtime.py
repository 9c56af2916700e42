"""What a run is made of: data, tracking, Ray, inference engines, worker groups, the generator.

`Runtime` is one context manager: `start()` (or `with`) builds the parts in dependency order,
`close()` takes down whatever was built, also after a failed start. The RL loop only uses them.
An eval-only runtime (`eval_only=True`, for `skylift eval`) builds the evaluation data, tracking,
the engines and the generator: no training data, no worker groups, no weight sync.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

import torch

from skylift.cluster.colocated_weights import OffloadingEngineWeights, colocated_weights
from skylift.cluster.colocation import (
    ColocationPlan,
    awake_engine_fraction,
    colocated_engine_fraction,
    colocation_plan,
)
from skylift.cluster.engine_weights import EngineWeights
from skylift.cluster.engines import (
    EngineRef,
    remote_engine_refs,
    start_inprocess_engines,
    start_local_engines,
)
from skylift.cluster.lora_run import LoraSync, lora_sync
from skylift.cluster.placement import uses_ray
from skylift.cluster.ray_start import start_ray_run
from skylift.cluster.routing_run import check_routing_replay
from skylift.cluster.run_paths import RunPaths
from skylift.cluster.settings import (
    critic_worker_settings,
    generator_settings,
    local_engine_kwargs,
    model_worker_settings,
    total_steps,
)
from skylift.cluster.vision_run import run_vision, vision_engine_kwargs
from skylift.cluster.worker_group import WorkerGroup
from skylift.config.schema import SkyliftConfig
from skylift.data import PromptDataset
from skylift.envs.registry import configure_run
from skylift.generator import Generator
from skylift.generator.plugins import RolloutContext, rollout_plugin
from skylift.generator.vision import VisionInputs
from skylift.inference.pool import EnginePool
from skylift.utils.loop_thread import LoopThread
from skylift.utils.quiet import quiet_libraries
from skylift.worker.training_worker import WorkerSettings

T = TypeVar("T")


def _quiet(text: str) -> None:
    pass


class Runtime:
    """The parts of one run, built from a `SkyliftConfig`; `say` prints progress lines."""

    def __init__(
        self,
        cfg: SkyliftConfig,
        say: Callable[[str], None] = _quiet,
        verbose: bool = False,
        eval_only: bool = False,
    ) -> None:
        """`verbose`: let the libraries print their own messages (see `skylift.utils.quiet`);
        `eval_only`: only what evaluation needs (see the module's docstring)."""
        self.cfg = cfg
        self.eval_only = eval_only
        self.say = say
        self.verbose = verbose
        quiet_libraries(verbose)
        self.paths = RunPaths.from_config(cfg)
        #: the run's one event loop, on a thread of its own until `close` (skylift.utils.loop_thread)
        self.loop = LoopThread(name="skylift-run-loop")
        self.engine_refs: list[EngineRef] = []
        self.engines: EnginePool | None = None
        self.policy: WorkerGroup | None = None
        self.ref: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.tracking: Any = None
        self.colocation = ColocationPlan(sleep_engines=False)
        self.lora = LoraSync(adapter=False)  # what a LoRA policy syncs (skylift.cluster.lora_run)
        self.use_ray = False
        self._ray_started = False
        self.weights: EngineWeights | OffloadingEngineWeights | None = None
        self.placement: Any = None  # PlacedGroups (skylift.cluster.placement) when the run uses Ray
        self.generator: Any = None  # skylift's Generator, or a rollout plugin's around it
        self.vision: VisionInputs | None = None  # a vision-language policy's image processing
        #: e.g. ``environment.verifiers`` (rows of env_class verifiers played by a verifiers env server)
        #: or ``environment.harness`` (an agent program through the gateway, which registers it here)
        from skylift.gateway import rollouts as _harness_plugin  # noqa: F401

        self.rollout_plugin = rollout_plugin(cfg.environment)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the run's event loop (the one the engines' clients live on) and wait
        for it, from any thread but the loop's."""
        return self.loop.run(coro)

    # ------------------------------------------------------------------ start
    def __enter__(self) -> Runtime:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        """Build every part in dependency order."""
        from transformers import AutoTokenizer

        from skylift.models import resolve_model_path
        from skylift.tracking import Tracking

        cfg, t, g = self.cfg, self.cfg.trainer, self.cfg.generator
        self.model_path = resolve_model_path(t.policy.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        env_class = cfg.environment.env_class
        columns = {"prompt_key": cfg.data.prompt_key, "env_class_key": cfg.data.env_class_key}
        self.train_data: PromptDataset | None = (
            None
            if self.eval_only
            else PromptDataset(
                cfg.data.train_data,
                default_env_class=env_class,
                max_rows=cfg.data.max_train_samples,
                **columns,
            )
        )
        self.val_data = (
            PromptDataset(
                cfg.data.val_data, default_env_class=env_class, max_rows=cfg.data.max_val_samples, **columns
            )
            if cfg.data.val_data
            else None
        )
        self.vision = run_vision(cfg, str(self.model_path), [self.train_data, self.val_data])
        check_routing_replay(cfg, str(self.model_path))
        self.lora = lora_sync(cfg, str(self.model_path))
        self.tracking = Tracking(t.loggers(), self.paths.logs, t.project_name, t.run_name)
        self.say(
            f"run '{t.run_name}': model {t.policy.model.path}, "
            + ("evaluation only, " if self.train_data is None else f"{len(self.train_data)} train prompts, ")
            + f"{len(self.val_data) if self.val_data else 0} eval prompts; outputs in {self.paths.root}"
        )

        world = 0 if self.eval_only else t.policy_world_size()
        self.use_ray = uses_ray(cfg, self.eval_only)
        self.colocation = colocation_plan(
            t.placement.colocate_all and not self.eval_only, torch.cuda.is_available(), g.run_engines_locally
        )
        if self.colocation.message:
            self.say(self.colocation.message)
        if self.lora.line:
            self.say(self.lora.line)
        if self.use_ray:  # join RAY_ADDRESS / trainer.ray_address or start one; reserve the placement
            ray_run = start_ray_run(cfg, training=not self.eval_only)
            self._ray_started, self.placement = ray_run.started, ray_run.placement
            for line in ray_run.lines:
                self.say(line)
        self._start_engines()
        if self.eval_only:
            self._start_generator()
            return
        total = self.total_steps()
        self.policy = self._worker_group("policy", model_worker_settings(cfg, True, total), world)
        self.policy.setup()
        if t.algorithm.use_kl_loss or t.algorithm.use_kl_in_reward:
            ref_world = t.placement.ref_num_nodes * t.placement.ref_num_gpus_per_node
            self.ref = self._worker_group("ref", model_worker_settings(cfg, False, total), ref_world)
            self.ref.setup()
        if t.algorithm.advantage_estimator == "gae":
            critic_world = t.placement.critic_num_nodes * t.placement.critic_num_gpus_per_node
            self.critic = self._worker_group("critic", critic_worker_settings(cfg, total), critic_world)
            self.critic.setup()
        self._start_generator()
        assert self.engines is not None
        self.weights = EngineWeights(
            cfg, self.policy, self.engines, self.run, self.say, lora_adapter=self.lora.adapter
        )
        self.weights.open()
        if self.colocation.sleep_engines:  # the trainer's state in host memory while engines are awake
            self.weights = colocated_weights(cfg, self.weights, self.policy, self.ref, self.critic, self.say)

    def _start_generator(self) -> None:
        env = self.cfg.environment  # modules of registrations; the env plugins' settings
        configure_run(env.env_class, env.import_modules, self.cfg.generator.max_turns, env)
        generator = Generator(self.engines, self.tokenizer, generator_settings(self.cfg), vision=self.vision)
        if self.rollout_plugin is None:
            self.generator = generator
            return
        plugin, settings = self.rollout_plugin
        context = RolloutContext(
            engine_urls=[ref.url for ref in self.engine_refs if ref.url],
            default_env_class=env.env_class,
            renderer_model=str(self.model_path),
            api_key=os.environ.get("SKYLIFT_API_KEY"),
        )
        self.generator = plugin.wrap(generator, settings, context)

    def total_steps(self) -> int:
        """Training steps of the whole run: the batches of all epochs, at most `trainer.max_steps`."""
        assert self.train_data is not None, "an eval-only runtime has no training steps"
        return total_steps(self.cfg, self.train_data.num_batches(self.cfg.trainer.train_batch_size))

    def _worker_group(self, name: str, settings: WorkerSettings, world: int) -> WorkerGroup:
        gpu = torch.cuda.is_available()
        return WorkerGroup(
            name,
            settings,
            world,
            use_ray=self.use_ray,
            num_cpus_per_worker=1 if gpu else 0,
            num_gpus_per_worker=1 if gpu else 0,
            timeout_s=self.cfg.trainer.worker_timeout_s,
            placement=self.placement,
        )

    def _start_engines(self) -> None:
        g = self.cfg.generator
        if g.run_engines_locally:
            kwargs = vision_engine_kwargs(
                self.vision,
                local_engine_kwargs(
                    self.cfg, sleep_mode=self.colocation.sleep_engines, lora_adapter=self.lora.adapter
                ),
            )
            # the engines' share of a GPU the trainer holds too: colocated (asleep while it trains),
            # or in-process on cuda:0 beside the training ranks' rank 0 (awake throughout)
            share = colocated_engine_fraction if self.colocation.sleep_engines else None
            if share is None and torch.cuda.is_available() and not self.use_ray and not self.eval_only:
                share = awake_engine_fraction
            if share is not None:
                gpu_bytes = torch.cuda.get_device_properties(0).total_memory
                kwargs["gpu_memory_utilization"] = share(self.cfg, self.model_path, gpu_bytes, self.say)
            kwargs.setdefault("use_tqdm_on_load", self.verbose)  # vLLM's checkpoint-shard bar
            started = time.perf_counter()
            where = "as Ray actors" if self.use_ray else "in this process"
            self.say(f"starting {g.num_inference_engines} local vLLM engine(s) {where}...")
            if self.use_ray:
                self.engine_refs = start_local_engines(
                    g.num_inference_engines,
                    self.model_path,
                    kwargs,
                    startup_timeout_s=g.engine_startup_timeout_s,
                    call_timeout_s=g.http_timeout_s,
                    placement=self.placement,
                )
            else:
                self.engine_refs = self.run(
                    asyncio.wait_for(
                        start_inprocess_engines(g.num_inference_engines, self.model_path, kwargs),
                        g.engine_startup_timeout_s,
                    )
                )
            self.say(f"engines up in {time.perf_counter() - started:.1f} s")
        else:
            self.engine_refs = remote_engine_refs(
                list(g.remote_inference_engine_urls), os.environ.get("SKYLIFT_API_KEY"), g.http_timeout_s
            )
        self.engines = EnginePool([ref.connect() for ref in self.engine_refs])

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the workers and engines, close the trackers and Ray (what was started), the loop."""
        if self.loop.closed:
            return
        try:
            if self.weights is not None:
                try:  # the engines leave the weight-update group, then the policy's rank 0
                    self.weights.close()
                except Exception as exc:  # noqa: BLE001 - a dead engine must not keep the rest up
                    self.say(f"closing the weight-update group: {type(exc).__name__}: {exc}")
            for name, group in (("policy", self.policy), ("ref", self.ref), ("critic", self.critic)):
                if group is not None:
                    try:
                        group.shutdown()
                    except Exception as exc:  # noqa: BLE001 - a dead worker must not keep the engines up
                        self.say(f"shutting down the {name} workers: {type(exc).__name__}: {exc}")
            aclose = getattr(self.generator, "aclose", None)
            if aclose is not None:  # a plugin's (verifiers' env-server socket lives on this loop)
                self.run(aclose())
            if self.engines is not None:
                self.run(self.engines.close())
            from skylift.inference.http_session import close_default_pool

            self.run(close_default_pool())  # remote engines' pooled HTTP session
        finally:
            if self.tracking is not None:
                self.tracking.close()
            if self.placement is not None:
                self.placement.remove()
            if self._ray_started:
                import ray

                ray.shutdown()
            self.loop.stop()
